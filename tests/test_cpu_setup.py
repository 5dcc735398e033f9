"""The BLAS thread count the engine chooses (EngineConfig.blas_threads) is the one in force afterwards."""
import logging
import platform
import sys

import pytest
from threadpoolctl import ThreadpoolController

from minisarathi.backends import cpu_setup
from minisarathi.engine.engine import LLMEngine


def blas_threads_in_force() -> set[int]:
    return {lib["num_threads"] for lib in ThreadpoolController().info() if lib["user_api"] == "blas"}


@pytest.fixture(autouse=True)
def restore_blas_threads():
    before = ThreadpoolController().select(user_api="blas")
    original = {lib.prefix: lib.num_threads for lib in before.lib_controllers}
    yield
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        lib.set_num_threads(original.get(lib.prefix, lib.num_threads))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_set_count_is_applied_and_logged(threads, caplog):
    with caplog.at_level(logging.INFO, logger="minisarathi.engine"):
        engine = LLMEngine(blas_threads=threads)
    assert blas_threads_in_force() == {threads}
    assert engine.cpu_setup.blas_threads == threads
    assert f"BLAS threads: {threads} (set)" in caplog.text


@pytest.mark.parametrize("cpus, load, expected", [(2, 0.1, 2), (2, 0.7, 1), (2, 6.5, 1), (8, 2.2, 6), (4, 0.0, 4)])
def test_auto_gives_blas_the_idle_cpus(monkeypatch, cpus, load, expected):
    monkeypatch.setattr(cpu_setup, "available_cpus", lambda: cpus)
    monkeypatch.setattr(cpu_setup.os, "getloadavg", lambda: (load, load, load))
    engine = LLMEngine()
    assert engine.cpu_setup.blas_threads == expected
    assert blas_threads_in_force() == {expected}
    assert engine.cpu_setup.how.startswith(f"auto: {cpus} CPUs, load average {load:.2f}")


def test_bad_counts_name_the_field():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="blas_threads"):
            LLMEngine(blas_threads=bad)


def test_without_threadpoolctl(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)     # import fails as if not installed
    with pytest.raises(ValueError, match=r"blas_threads \(2\) needs threadpoolctl"):
        LLMEngine(blas_threads=2)
    setup = LLMEngine().cpu_setup                                 # auto: runs, and says why nothing was set
    assert setup.blas_threads is None and "threadpoolctl is not installed" in setup.how


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_allocator_thresholds_are_accepted_by_glibc():
    assert cpu_setup.tune_allocator()
