"""Each kernel's static resources as a GPU sees them: the file compiled with NVRTC, as CuPy's RawModule
compiles it (no driver needed), and read from the cubin's ELF sections, cached by a hash of the source and its
headers.

    static shared memory   .nv.shared.<mangled name>'s size (sm_90 cubins lay the system's 1 KiB reservation
                           into it: not counted, it is the device's reserved_shared_memory_per_block)
    registers per thread   EIATTR_REGCOUNT of the kernel's symbol in .nv.info
    max threads per block  EIATTR_MAX_THREADS (__launch_bounds__) in .nv.info.<mangled name>, else 1024

Needs NVRTC (`pip install "cuda-toolkit[nvrtc,cudart]==13.0.*" cupy-cuda13x`). Without it a module does not
load, unless MINISARATHI_SKIP_NVRTC=1 says so on purpose: then static shared memory counts as 0 and registers
as unknown, and a warning says that the emulator no longer refuses what a GPU would.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from minisarathi.backends.native_build import cache_dir

logger = logging.getLogger(__name__)

FORMAT = 1  # of the cached JSON: bump when what is read from the cubin changes
EIATTR_MAX_THREADS, EIATTR_REGCOUNT = 0x05, 0x2F
EIFMT_SVAL = 4  # an attribute with a u16 size and that many bytes; the others carry a u16 value


@dataclass(frozen=True)
class KernelResources:
    static_shared_bytes: int
    registers: int | None  # per thread; None when unknown (no NVRTC)
    max_threads_per_block: int


UNKNOWN = KernelResources(0, None, 1024)


def _nvrtc():
    """(cupy.cuda.nvrtc, the options CuPy's RawModule adds to the caller's) or raises ImportError."""
    import cupy
    from cupy.cuda import nvrtc

    from cuda import pathfinder

    nvrtc.getVersion()  # loads libnvrtc: fails here when only the binding is installed
    cudart = pathfinder.find_nvidia_header_directory("cudart")
    if cudart is None:
        raise ImportError("cudart headers not found (cuda-toolkit[cudart])")
    return nvrtc, [
        "-ftz=true",
        "--device-as-default-execution-space",
        f"-I{cudart}",
        f"-I{Path(cupy.__file__).parent / '_core' / 'include'}",
    ]


def nvrtc_missing() -> str | None:
    """Why NVRTC cannot compile here (so modules load only with MINISARATHI_SKIP_NVRTC=1), or None."""
    try:
        _nvrtc()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def kernel_resources(
    source: Path, name_expressions: list[str], include_dirs: list[Path], options: tuple[str, ...], arch: str
) -> dict[str, KernelResources]:
    """Name expression -> its KernelResources compiled for `arch` with `options` (CuPy's RawModule
    options)."""
    try:
        nvrtc, cupy_options = _nvrtc()
    except Exception as exc:
        if os.environ.get("MINISARATHI_SKIP_NVRTC") != "1":
            raise RuntimeError(
                "the CUDA emulator reads each kernel's static shared memory and registers from its NVRTC "
                "cubin, "
                f"and NVRTC is unavailable ({type(exc).__name__}: {exc}): pip install "
                '"cuda-toolkit[nvrtc,cudart]==13.0.*" cupy-cuda13x, or set MINISARATHI_SKIP_NVRTC=1 to run '
                "without those checks"
            ) from exc
        logger.warning(
            "MINISARATHI_SKIP_NVRTC=1: %s runs with no static shared memory or register limits "
            "(the emulator accepts launches a GPU may refuse)",
            source.name,
        )
        return {name: UNKNOWN for name in name_expressions}
    headers = sorted(
        {
            p
            for folder in (source.parent, *include_dirs)
            for pattern in ("*.cuh", "*.h")
            for p in folder.glob(pattern)
        }
    )
    flags = [
        *options,
        f"-I{source.parent}",
        *[f"-I{d}" for d in include_dirs],
        *cupy_options,
        f"-arch={arch}",
    ]
    digest = hashlib.sha256(json.dumps([FORMAT, flags, name_expressions, nvrtc.getVersion()]).encode())
    for path in (source, *headers):  # the source and every header it could include: editing one recompiles
        digest.update(path.read_bytes())
    cached = cache_dir("emulator") / f"{source.stem}-{arch}-{digest.hexdigest()[:16]}.resources.json"
    if cached.is_file():
        return {name: KernelResources(**value) for name, value in json.loads(cached.read_text()).items()}
    resources = _compile(nvrtc, source, name_expressions, flags)
    temporary = cached.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.write_text(json.dumps({name: asdict(r) for name, r in resources.items()}))
    temporary.replace(cached)  # atomic: a racing process reads the whole file or none
    return resources


def _compile(
    nvrtc, source: Path, name_expressions: list[str], flags: list[str]
) -> dict[str, KernelResources]:
    program = nvrtc.createProgram(source.read_text(), source.name, [], [])
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, flags)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(
                f"{source.name}: NVRTC failed ({exc}):\n{nvrtc.getProgramLog(program)}"
            ) from exc
        lowered = {name: nvrtc.getLoweredName(program, name) for name in name_expressions}
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    return read_cubin(cubin, lowered)


def read_cubin(cubin: bytes, lowered: dict[str, str]) -> dict[str, KernelResources]:
    """Name expression -> KernelResources, from an ELF64 cubin and each name's mangled (lowered) name."""
    sections = _sections(cubin)
    # sm_90 cubins have this section, and put the per-block reservation at the start of every shared section.
    reserved = 1024 if ".nv.shared.reserved.0" in sections else 0
    symbols = _symbol_names(cubin, sections)
    registers = {
        symbols[values[0]]: values[1]
        for attr, values in _attributes(cubin, sections, ".nv.info")
        if attr == EIATTR_REGCOUNT
    }
    result = {}
    for name, mangled in lowered.items():
        shared = sections.get(f".nv.shared.{mangled}")
        threads = [
            math.prod(dims)
            for attr, dims in _attributes(cubin, sections, f".nv.info.{mangled}")
            if attr == EIATTR_MAX_THREADS
        ]
        result[name] = KernelResources(
            max(0, shared[1] - reserved) if shared else 0, registers[mangled], threads[0] if threads else 1024
        )
    return result


def _sections(elf: bytes) -> dict[str, tuple[int, int]]:
    """Section name -> (file offset, size)."""
    if elf[:5] != b"\x7fELF\x02":
        raise ValueError("not an ELF64 cubin")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entry_size) for i in range(count)]
    names_offset = headers[names_index][4]
    return {_string(elf, names_offset + h[0]): (h[4], h[5]) for h in headers}


def _symbol_names(elf: bytes, sections: dict[str, tuple[int, int]]) -> list[str]:
    (offset, size), (strings, _) = sections[".symtab"], sections[".strtab"]
    return [
        _string(elf, strings + struct.unpack_from("<I", elf, offset + i * 24)[0]) for i in range(size // 24)
    ]


def _attributes(elf: bytes, sections: dict[str, tuple[int, int]], name: str):
    """(EIATTR id, u32 values) of a .nv.info section's sized attributes."""
    offset, size = sections.get(name, (0, 0))
    end, i = offset + size, offset
    while i < end:
        form, attr, length = elf[i], elf[i + 1], struct.unpack_from("<H", elf, i + 2)[0]
        if form == EIFMT_SVAL:
            yield attr, struct.unpack_from(f"<{length // 4}I", elf, i + 4)
            i += 4 + length
        else:
            i += 4


def _string(elf: bytes, start: int) -> str:
    return elf[start : elf.index(b"\0", start)].decode()
