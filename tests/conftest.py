"""Fixtures shared by test modules, and the two tiers: every test under tests/system is marked `system`
(servers, subprocesses, compilers, the CUDA emulator), so `python -m pytest -m "not system"` runs the fast
tier."""

import os
from pathlib import Path

import pytest

from minisarathi.backends.cpu import ops
from minisarathi.backends.emulator import cubin

# CpuOps.linear's two products (ops.transposed_linear), each chosen by an OpenBLAS core: tests that
# run the model take both, whatever kernels this machine's OpenBLAS uses.
LINEAR_FORMS = {"x@w.T": None, "(w@x.T).T": "SkylakeX"}


@pytest.fixture(params=list(LINEAR_FORMS))
def blas_core(request, monkeypatch):
    """The OpenBLAS core that CpuOps made from now on believe in force (set it on older ones): x @ w.T at
    every row count, or the transposed product at the rows transposed_linear gives it."""
    core = LINEAR_FORMS[request.param]
    monkeypatch.setattr(ops, "openblas_core", lambda: core)
    return core


SYSTEM_DIR = Path(__file__).parent / "system"


def pytest_collection_modifyitems(items):
    no_nvrtc = pytest.mark.skip(
        reason='NVRTC unavailable (MINISARATHI_SKIP_NVRTC=1): pip install -e ".[test-cuda]"'
    )
    for item in items:
        if SYSTEM_DIR in Path(item.path).parents:
            item.add_marker(pytest.mark.system)
        if "needs_nvrtc" in item.keywords and os.environ.get("MINISARATHI_SKIP_NVRTC") == "1":
            item.add_marker(no_nvrtc)


def pytest_configure(config):
    # A CPU machine with only .[test]: the emulator checks kernel logic without the cubins' limits, and the
    # tests of those limits skip. CI installs .[test-cuda], so there a missing NVRTC fails instead.
    if "MINISARATHI_SKIP_NVRTC" not in os.environ and not os.environ.get("CI") and cubin.nvrtc_missing():
        os.environ["MINISARATHI_SKIP_NVRTC"] = "1"


def pytest_report_header(config):
    if os.environ.get("MINISARATHI_SKIP_NVRTC") == "1":
        return (
            "NVRTC unavailable: the CUDA emulator runs without kernels' static shared memory and register "
            "limits, "
            'and the tests of those limits skip (pip install -e ".[test-cuda]")'
        )
