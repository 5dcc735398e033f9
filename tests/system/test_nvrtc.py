"""Every kernel file and every template instantiation compiles with NVRTC for sm_80 and sm_90, no GPU needed,
without a stack frame or spills (what the GPU runs is NVRTC's code, which can differ from nvcc's).

NVRTC is called through CuPy's thin binding (cupy.cuda.nvrtc), which works without a driver, with the
options CuPy's RawModule uses at run time. Needs `pip install "cuda-toolkit[nvrtc,cudart]==13.0.*"
cupy-cuda13x`. Without them the tests skip, except under CI (the CI environment variable set), where they fail
unless MINISARATHI_SKIP_NVRTC=1 says the job has no NVRTC on purpose.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_sass import local_memory_users, resources

from minisarathi.backends import cuda_ops
from minisarathi.paths import cuda_dir

ARCHITECTURES = ["sm_80", "sm_90"]
CHECK_KERNELS = Path(__file__).parents[1] / "kernels"


@pytest.fixture(scope="module")
def nvrtc_options():
    try:
        import cupy
        from cupy.cuda import nvrtc

        from cuda import pathfinder

        nvrtc.getVersion()  # loads libnvrtc: fails here when only the binding is installed
        cudart_include = pathfinder.find_nvidia_header_directory("cudart")
        if cudart_include is None:
            raise ImportError("cudart headers not found (cuda-toolkit[cudart])")
    except Exception as exc:
        message = f"NVRTC unavailable: {type(exc).__name__}: {exc}"
        if os.environ.get("CI") and os.environ.get("MINISARATHI_SKIP_NVRTC") != "1":
            pytest.fail(message + ' (CI: pip install "cuda-toolkit[nvrtc,cudart]==13.0.*" cupy-cuda13x)')
        pytest.skip(message)
    cupy_include = Path(cupy.__file__).parent / "_core" / "include"
    # What RawModule(code=..., options=cuda_ops.NVRTC_OPTIONS + (-I cuda_dir,)) ends up passing.
    return nvrtc, [
        *cuda_ops.NVRTC_OPTIONS,
        f"-I{cuda_dir()}",
        "-ftz=true",
        "--device-as-default-execution-space",
        f"-I{cudart_include}",
        f"-I{cupy_include}",
    ]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("file", cuda_ops.kernel_files())
def test_kernel_file_compiles(nvrtc_options, file, arch):
    nvrtc, options = nvrtc_options
    names = cuda_ops.name_expressions(file)
    program = nvrtc.createProgram((cuda_dir() / file).read_text(), file, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(
                program, [*options, f"-arch={arch}", "-Xptxas=-v"]
            )  # -v: ptxas's resource report
        except nvrtc.NVRTCError as exc:
            pytest.fail(f"{file} ({arch}): {exc}\n{nvrtc.getProgramLog(program)}")
        log = nvrtc.getProgramLog(program).strip()
        assert "warning" not in log.lower(), log
        used = resources(log)
        for name in names:
            assert nvrtc.getLoweredName(program, name) in used, name  # the instantiation exists
        assert not local_memory_users(used), f"{file} ({arch}): {local_memory_users(used)}"
        assert len(nvrtc.getCUBIN(program)) > 0
    finally:
        nvrtc.destroyProgram(program)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("file", sorted(p.name for p in CHECK_KERNELS.glob("*.cu")))
def test_emulator_check_kernels_compile(nvrtc_options, file, arch):
    """The tests' own kernels (tests/kernels, explicit instantiations) take the same PTX paths as cuda/."""
    nvrtc, options = nvrtc_options
    program = nvrtc.createProgram((CHECK_KERNELS / file).read_text(), file, [], [])
    try:
        try:
            nvrtc.compileProgram(program, [*options, f"-arch={arch}"])
        except nvrtc.NVRTCError as exc:
            pytest.fail(f"{file} ({arch}): {exc}\n{nvrtc.getProgramLog(program)}")
        assert len(nvrtc.getCUBIN(program)) > 0
    finally:
        nvrtc.destroyProgram(program)


def test_every_kernel_file_is_checked():
    assert sorted(cuda_ops.kernel_files()) == sorted(p.name for p in cuda_dir().glob("*.cu"))
