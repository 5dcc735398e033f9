"""The BLAS thread count the engine chooses (EngineConfig.blas_threads) is the one in force afterwards, for
BLAS and the native matmuls (process_setup.kernel_threads); the OpenBLAS kernels in force are logged with
where they come from."""

import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from threadpoolctl import ThreadpoolController

from minisarathi.backends.cpu import process_setup
from minisarathi.engine.engine import LLMEngine


def blas_threads_in_force() -> set[int]:
    return {lib["num_threads"] for lib in ThreadpoolController().info() if lib["user_api"] == "blas"}


@pytest.fixture(autouse=True)
def restore_blas_threads():
    before = ThreadpoolController().select(user_api="blas")
    original = {lib.prefix: lib.num_threads for lib in before.lib_controllers}
    kernel_threads = process_setup.kernel_threads()
    yield
    process_setup._kernel_threads = kernel_threads
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        lib.set_num_threads(original.get(lib.prefix, lib.num_threads))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_set_count_is_applied_and_logged(threads, caplog):
    with caplog.at_level(logging.INFO, logger="minisarathi.engine"):
        engine = LLMEngine(blas_threads=threads)
    assert blas_threads_in_force() == {threads}
    assert engine.cpu_setup.blas_threads == threads == process_setup.kernel_threads()
    assert f"BLAS threads: {threads} (set)" in caplog.text


def test_a_quantized_or_16_bit_weight_leaves_blas_one_thread():
    """The native matmuls keep their threads and BLAS (then only attention's products) gets one, so that
    OpenBLAS's spinning threads do not take the cores from the kernels'; a float32 weight leaves BLAS as
    set (negative control), and configure_cpu sets it again."""
    import numpy as np

    from minisarathi.backends.cpu.ops import CpuOps
    from minisarathi.model.loader import CheckpointTensor
    from minisarathi.quant import kquants
    from minisarathi.quant.layouts import GgmlType, from_gguf

    w = np.random.default_rng(0).standard_normal((4, 256), dtype=np.float32)
    quantized = CheckpointTensor("q", from_gguf("w", GgmlType.Q4_K, kquants.quantize(w, "Q4_K")))
    process_setup.configure_cpu(2)
    CpuOps().weight(w)
    assert blas_threads_in_force() == {2} and process_setup.kernel_threads() == 2
    CpuOps().weight(quantized)
    assert blas_threads_in_force() == {1} and process_setup.kernel_threads() == 2
    process_setup.configure_cpu(2)
    assert blas_threads_in_force() == {2}
    CpuOps("bfloat16").weight(w)
    assert blas_threads_in_force() == {1}
    process_setup.configure_cpu(1)  # one thread for all: nothing to yield
    CpuOps().weight(quantized)
    assert blas_threads_in_force() == {1} and process_setup.kernel_threads() == 1


@pytest.mark.parametrize(
    "cpus, load, expected", [(2, 0.1, 2), (2, 0.7, 1), (2, 6.5, 1), (8, 2.2, 6), (4, 0.0, 4)]
)
def test_auto_gives_blas_the_idle_cpus(monkeypatch, cpus, load, expected):
    monkeypatch.setattr(process_setup, "available_cpus", lambda: cpus)
    monkeypatch.setattr(process_setup.os, "getloadavg", lambda: (load, load, load))
    engine = LLMEngine()
    assert engine.cpu_setup.blas_threads == expected == process_setup.kernel_threads()
    assert blas_threads_in_force() == {expected}
    assert engine.cpu_setup.how.startswith(f"auto: {cpus} CPUs, load average {load:.2f}")


def test_bad_counts_name_the_field():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="blas_threads"):
            LLMEngine(blas_threads=bad)


def test_without_threadpoolctl(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"blas_threads \(2\) needs threadpoolctl"):
        LLMEngine(blas_threads=2)
    setup = LLMEngine().cpu_setup  # auto: runs, and says why nothing was set
    assert setup.blas_threads is None and "threadpoolctl is not installed" in setup.how


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_allocator_thresholds_are_accepted_by_glibc():
    assert process_setup.tune_allocator()


ZEN4_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16
processor\t: 1
flags\t\t: fpu sse2
"""


def test_cpu_flags_are_the_first_processors():
    assert process_setup.AVX512_FLAGS <= process_setup.cpu_flags(ZEN4_CPUINFO)
    assert process_setup.cpu_flags("processor: 0\n") == frozenset()


def kernels_in_a_fresh_process(coretype: str | None, cpuinfo: Path) -> str:
    """The engine's log text for the OpenBLAS kernels, in a process whose OpenBLAS loaded under `coretype`."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    if coretype is not None:
        env["OPENBLAS_CORETYPE"] = coretype
    code = (
        "import numpy\nfrom minisarathi.backends.cpu.process_setup import blas_kernels\n"
        f"print(blas_kernels({str(cpuinfo)!r}))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="OpenBLAS core names are x86-64's")
def test_the_openblas_core_in_force_is_logged_with_where_it_comes_from(tmp_path):
    zen4 = tmp_path / "cpuinfo"
    zen4.write_text(ZEN4_CPUINFO)
    # a forced older core on an AVX-512 CPU: named, with the hint
    assert kernels_in_a_fresh_process("Haswell", zen4) == (
        "Haswell (OPENBLAS_CORETYPE=Haswell in the environment; this CPU has AVX-512: unset it for "
        "OpenBLAS's "
        "own choice, faster matmuls)"
    )
    # on a CPU without AVX-512, no hint
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor: 0\nflags: fpu avx avx2 fma\n")
    assert (
        kernels_in_a_fresh_process("Haswell", avx2)
        == "Haswell (OPENBLAS_CORETYPE=Haswell in the environment)"
    )
    assert kernels_in_a_fresh_process(None, avx2).endswith("(OpenBLAS's choice for this CPU)")


def test_the_engine_logs_the_kernels(caplog):
    with caplog.at_level(logging.INFO, logger="minisarathi.engine"):
        engine = LLMEngine(blas_threads=1)
    assert f"BLAS kernels: {engine.cpu_setup.blas_kernels};" in caplog.text
    assert engine.cpu_setup.blas_kernels.split()[0] in {
        i["architecture"] for i in ThreadpoolController().info() if i["internal_api"] == "openblas"
    }
