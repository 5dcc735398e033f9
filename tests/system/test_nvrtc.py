"""Every kernel file and every template instantiation compiles with NVRTC for sm_80 and sm_90, no GPU needed,
without a stack frame or spills (what the GPU runs is NVRTC's code, which can differ from nvcc's). The
compiles are nvrtc_build's, shared with the SASS tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nvrtc_build import ARCHITECTURES, build, build_kernel_file, require_nvrtc
from test_sass import local_memory_users, resources

from minisarathi.backends import cuda_ops
from minisarathi.paths import cuda_dir

CHECK_KERNELS = Path(__file__).parents[1] / "kernels"


@pytest.fixture(scope="module")
def nvrtc_options():
    return require_nvrtc()


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("file", cuda_ops.kernel_files())
def test_kernel_file_compiles(nvrtc_options, file, arch):
    built = build_kernel_file(file, arch)
    assert "warning" not in built.log.lower(), built.log
    used = resources(built.log)
    for name, lowered in built.lowered.items():
        assert lowered in used, name  # the instantiation exists
    assert not local_memory_users(used), f"{file} ({arch}): {local_memory_users(used)}"
    assert len(built.cubin) > 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("file", sorted(p.name for p in CHECK_KERNELS.glob("*.cu")))
def test_emulator_check_kernels_compile(nvrtc_options, file, arch):
    """The tests' own kernels (tests/kernels, explicit instantiations) take the same PTX paths as cuda/."""
    assert len(build(CHECK_KERNELS / file, arch).cubin) > 0


def test_every_kernel_file_is_checked():
    assert sorted(cuda_ops.kernel_files()) == sorted(p.name for p in cuda_dir().glob("*.cu"))
