"""Fixtures shared by test modules, and the two tiers: every test under tests/system is marked `system` (servers,
subprocesses, compilers, the CUDA emulator), so `python -m pytest -m "not system"` runs the fast tier."""
from pathlib import Path

import pytest

from minisarathi.backends.cpu import ops

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
    for item in items:
        if SYSTEM_DIR in Path(item.path).parents:
            item.add_marker(pytest.mark.system)
