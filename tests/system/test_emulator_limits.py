"""The emulator refuses the launches a GPU refuses: static shared memory (read from the NVRTC cubin) plus
dynamic above 48 KiB without the opt-in, the opt-in above the device's maximum (sm_90 and sm_80), and
CudaOps opts each kernel in once, not every step. Cooperative launches: tests/system/test_gpu_sampling.py."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends import cuda_ops, emulator
from minisarathi.backends.emulator import cubin, launcher
from minisarathi.backends.gpu_sampling import SAMPLING
from minisarathi.paths import cuda_dir
from minisarathi.testing import scattered_batch

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)
CHECKS = Path(__file__).parents[1] / "kernels" / "shared_memory_checks.cu"
STATIC = 16 * 1024  # the check kernel's __shared__ float scratch[4096]
EXPECTED = list(range(32, 0, -1))  # out[t] = scratch[31 - t] + 1


def check_kernel(device=emulator.H100):
    return emulator.load_module(CHECKS, ["static_and_dynamic_shared"], device=device).get_function(
        "static_and_dynamic_shared"
    )


def run(kernel, dynamic: int) -> np.ndarray:
    out = np.zeros(32, np.float32)
    kernel((1,), (32,), (out,), shared_mem=dynamic)
    return out


@pytest.mark.needs_nvrtc
@pytest.mark.parametrize("device", [emulator.H100, emulator.A100], ids=["sm_90", "sm_80"])
def test_static_shared_memory_is_the_cubins(device):
    """sm_90 cubins count the system's 1 KiB per block in the section: not static memory of the kernel."""
    assert check_kernel(device).attributes["shared_size_bytes"] == STATIC
    sample = (
        emulator.load_module(
            cuda_dir() / "sampling.cu", cuda_ops.name_expressions("sampling.cu"), device=device
        )
        .get_function("sample_kernel")
        .attributes
    )
    assert 16 * 1024 < sample["shared_size_bytes"] < 18 * 1024
    assert (
        0 < sample["num_regs"] <= 64 and sample["max_threads_per_block"] == 1024
    )  # __launch_bounds__(1024, 1)


def test_sample_kernels_largest_chunk_fits_an_a100():
    """SAMPLE_MAX_CHUNK's float32 logits plus the static scratch fit sm_80's 163 KiB opt-in."""
    kernel = emulator.load_module(
        cuda_dir() / "sampling.cu", cuda_ops.name_expressions("sampling.cu"), device=emulator.A100
    ).get_function("sample_kernel")
    kernel.max_dynamic_shared_size_bytes = 4 * SAMPLING["SAMPLE_MAX_CHUNK"]


@pytest.mark.needs_nvrtc
def test_static_plus_dynamic_over_48_kib_needs_the_opt_in():
    kernel = emulator.EmulatedModule(CHECKS, ["static_and_dynamic_shared"]).get_function(
        "static_and_dynamic_shared"
    )
    assert kernel.max_dynamic_shared_size_bytes == 48 * 1024 - STATIC
    assert run(kernel, 48 * 1024 - STATIC).tolist() == EXPECTED  # 48 KiB in all: launches
    with pytest.raises(emulator.CUDADriverError, match="CUDA_ERROR_INVALID_VALUE.*32784 bytes of dynamic"):
        run(kernel, 48 * 1024 - STATIC + 16)
    kernel.max_dynamic_shared_size_bytes = 48 * 1024 - STATIC + 16
    assert run(kernel, 48 * 1024 - STATIC + 16).tolist() == EXPECTED


@pytest.mark.needs_nvrtc
@pytest.mark.parametrize(
    "device, optin", [(emulator.H100, 232448), (emulator.A100, 166912)], ids=["sm_90", "sm_80"]
)
def test_opt_in_stops_at_the_device_maximum_minus_static(device, optin):
    kernel = emulator.EmulatedModule(CHECKS, ["static_and_dynamic_shared"], device=device).get_function(
        "static_and_dynamic_shared"
    )
    with pytest.raises(emulator.CUDADriverError, match=f"at most {optin - STATIC}"):
        kernel.max_dynamic_shared_size_bytes = optin - STATIC + 1
    kernel.max_dynamic_shared_size_bytes = optin - STATIC
    assert run(kernel, optin - STATIC).tolist() == EXPECTED
    with pytest.raises(emulator.CUDADriverError):
        run(kernel, optin - STATIC + 4)


def count_attribute_sets(monkeypatch) -> list[str]:
    sets = []
    attribute = emulator.EmulatedKernel.max_dynamic_shared_size_bytes
    monkeypatch.setattr(
        emulator.EmulatedKernel,
        "max_dynamic_shared_size_bytes",
        property(attribute.fget, lambda kernel, n: sets.append(kernel.name) or attribute.fset(kernel, n)),
    )
    return sets


@pytest.mark.needs_nvrtc
def test_allow_shared_mem_counts_static_memory_opts_in_once_and_never_lowers(monkeypatch):
    sets = count_attribute_sets(monkeypatch)
    kernel = emulator.EmulatedModule(CHECKS, ["static_and_dynamic_shared"]).get_function(
        "static_and_dynamic_shared"
    )
    ops, other = cuda_ops.emulated(), cuda_ops.emulated()
    ops._allow_shared_mem(kernel, 48 * 1024 - STATIC)
    assert sets == []  # fits in 48 KiB with its static memory
    for _ in range(3):
        ops._allow_shared_mem(kernel, 40000)
        run(kernel, 40000)
    assert sets == ["static_and_dynamic_shared"]  # once, not per launch
    other._allow_shared_mem(kernel, 36000)  # another CudaOps over the same kernel
    run(kernel, 40000)
    assert kernel.max_dynamic_shared_size_bytes == 40000


def test_prefill_attention_opts_in_once_over_steps(monkeypatch):
    """Only the opt-in is checked here, so the launch itself is left out
    (tests/system/test_prefill_attention.py runs the kernel): each step's shared memory within the kernel's
    limit, the attribute set at the first step only."""
    sets = count_attribute_sets(monkeypatch)
    launches = []
    monkeypatch.setattr(
        emulator.EmulatedKernel,
        "__call__",
        lambda kernel, grid, block, args, shared_mem=0: launches.append(
            shared_mem <= kernel.max_dynamic_shared_size_bytes
        ),
    )
    rng = np.random.default_rng(0)
    batch, num_blocks = scattered_batch(rng, [(5, 20)], 16)
    k_cache = v_cache = np.zeros((num_blocks, 1, 16, 128), np.uint16)  # bfloat16 bits; head_dim 128: > 48 KiB
    q = np.zeros((batch.num_tokens, 1, 128), np.uint16)
    ops = cuda_ops.emulated("bfloat16")
    for _ in range(3):
        ops._prefill_attention(q, k_cache, v_cache, batch, 128**-0.5, np.zeros_like(q), np.int32(0))
    assert launches == [True] * 3
    assert sets == ["prefill_attention_kernel<__nv_bfloat16, 128>"]


def test_without_nvrtc_modules_do_not_load_unless_told(monkeypatch):
    def unavailable():
        raise ImportError("no libnvrtc")

    monkeypatch.setattr(cubin, "_nvrtc", unavailable)
    monkeypatch.delenv("MINISARATHI_SKIP_NVRTC", raising=False)
    with pytest.raises(RuntimeError, match="NVRTC is unavailable .*MINISARATHI_SKIP_NVRTC=1"):
        cubin.kernel_resources(CHECKS, ["static_and_dynamic_shared"], [], launcher.NVRTC_OPTIONS, "sm_90")
    monkeypatch.setenv("MINISARATHI_SKIP_NVRTC", "1")
    assert cubin.kernel_resources(
        CHECKS, ["static_and_dynamic_shared"], [], launcher.NVRTC_OPTIONS, "sm_90"
    ) == {"static_and_dynamic_shared": cubin.UNKNOWN}


def test_emulator_compiles_with_the_options_the_gpu_path_uses():
    assert set(launcher.NVRTC_OPTIONS) <= set(cuda_ops.NVRTC_OPTIONS)
