"""NVRTC compiles shared by the compile, SASS and learning-path tests: each kernel file is compiled once per
architecture, with the options CuPy's RawModule passes at run time (NVRTC's code is what a GPU runs), and
its cubin, ptxas -v log and lowered names kept for every test that reads them.

NVRTC is called through CuPy's thin binding (cupy.cuda.nvrtc), which works without a driver. Needs
`pip install "cuda-toolkit[nvrtc,cudart]==13.0.*" cupy-cuda13x`. Without them the tests skip, except under CI
(the CI environment variable set), where they fail unless MINISARATHI_SKIP_NVRTC=1 says the job has no
NVRTC on purpose.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import NamedTuple

import pytest

from minisarathi.backends import cuda_ops
from minisarathi.paths import cuda_dir

ARCHITECTURES = ["sm_80", "sm_90"]


class Build(NamedTuple):
    cubin: bytes
    log: str  # NVRTC's program log: ptxas -v's resource report per kernel
    lowered: dict[str, str]  # name expression -> mangled kernel name


@functools.lru_cache(maxsize=None)
def _nvrtc_and_options():
    import cupy
    from cupy.cuda import nvrtc

    from cuda import pathfinder

    nvrtc.getVersion()  # loads libnvrtc: fails here when only the binding is installed
    cudart_include = pathfinder.find_nvidia_header_directory("cudart")
    if cudart_include is None:
        raise ImportError("cudart headers not found (cuda-toolkit[cudart])")
    cupy_include = Path(cupy.__file__).parent / "_core" / "include"
    # What RawModule(code=..., options=cuda_ops.NVRTC_OPTIONS + (-I cuda_dir,)) ends up passing.
    return nvrtc, (
        *cuda_ops.NVRTC_OPTIONS,
        f"-I{cuda_dir()}",
        "-ftz=true",
        "--device-as-default-execution-space",
        f"-I{cudart_include}",
        f"-I{cupy_include}",
    )


def require_nvrtc():
    """(the nvrtc binding, RawModule's options), or the test skips (fails under CI) saying what is missing."""
    try:
        return _nvrtc_and_options()
    except Exception as exc:
        message = f"NVRTC unavailable: {type(exc).__name__}: {exc}"
        if os.environ.get("CI") and os.environ.get("MINISARATHI_SKIP_NVRTC") != "1":
            pytest.fail(message + ' (CI: pip install "cuda-toolkit[nvrtc,cudart]==13.0.*" cupy-cuda13x)')
        pytest.skip(message)


@functools.lru_cache(maxsize=None)
def build(source: Path, arch: str, names: tuple[str, ...] = ()) -> Build:
    """The file compiled for `arch` with every name expression instantiated; a compile error fails the test
    that asked, with NVRTC's log."""
    nvrtc, options = require_nvrtc()
    program = nvrtc.createProgram(source.read_text(), source.name, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, [*options, f"-arch={arch}", "-Xptxas=-v"])  # -v: resources
        except nvrtc.NVRTCError as exc:
            pytest.fail(f"{source.name} ({arch}): {exc}\n{nvrtc.getProgramLog(program)}")
        # CuPy 14's getCUBIN hands the ELF back less its last byte, as it would a NUL-terminated PTX string;
        # that byte is the high byte of the last program header's alignment, a zero.
        return Build(
            nvrtc.getCUBIN(program) + b"\0",
            nvrtc.getProgramLog(program).strip(),
            {name: nvrtc.getLoweredName(program, name) for name in names},
        )
    finally:
        nvrtc.destroyProgram(program)


def build_kernel_file(file: str, arch: str) -> Build:
    """cuda/<file> as the CUDA backend loads it."""
    return build(cuda_dir() / file, arch, tuple(cuda_ops.name_expressions(file)))
