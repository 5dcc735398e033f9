"""Builds a .cu file with g++ against the emulator's shim header into a shared library, cached by content
(minisarathi/backends/native_build.py)."""

from __future__ import annotations

import os
from pathlib import Path

from minisarathi.backends.native_build import build_shared_library

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
SHIM_HEADER = INCLUDE_DIR / "minisarathi_emu.h"

# -fno-extern-tls-init: `extern __shared__` becomes an extern thread_local; without it every access
# would go through a TLS wrapper call. -z defs: an unresolved symbol fails at build, not at dlopen.
FLAGS = [
    "-std=c++20",
    "-shared",
    "-fPIC",
    "-pthread",
    "-fno-strict-aliasing",
    "-fno-extern-tls-init",
    "-fvisibility=hidden",
    "-Wall",
    "-Wno-unused-function",
    "-Wno-unused-variable",
    "-Wl,-z,defs",
]


def optimization_flags() -> list[str]:
    # MINISARATHI_EMU_DEBUG=1 builds for stepping through a kernel in gdb (no inlining, no reordering).
    return ["-O0", "-g3"] if os.environ.get("MINISARATHI_EMU_DEBUG") == "1" else ["-O1", "-g"]


def wrapper_source(source: Path, name_expressions: list[str]) -> str:
    """The translation unit g++ compiles: the .cu file plus, per kernel, a launch stub and its signature."""
    lines = [f'#include "{source}"', ""]
    for i, expr in enumerate(name_expressions):
        lines += [
            f'extern "C" __attribute__((visibility("default"))) int minisarathi_emu_launch_{i}('
            f"const emu::LaunchArgs* cfg, void** args, char* error, int error_len) {{",
            f"    return emu::launch(&{expr}, cfg, args, error, error_len);",
            "}",
            f'extern "C" __attribute__((visibility("default"))) const char* minisarathi_emu_signature_{i}() '
            f"{{",
            f"    return emu::signature(&{expr});",
            "}",
        ]
    return "\n".join(lines) + "\n"


def build(source: str | Path, name_expressions: list[str], include_dirs: list[str | Path] = ()) -> Path:
    """Returns the path of the shared library for `source` exporting one launch stub per name expression.
    Headers are searched beside the source, then in include_dirs."""
    source = Path(source).resolve()
    include_dirs = [Path(d).resolve() for d in include_dirs]
    if not source.is_file():
        raise ValueError(f"source: no such kernel file {source}")
    if not name_expressions:
        raise ValueError("name_expressions: give at least one kernel name")
    flags = (
        FLAGS
        + optimization_flags()
        + [
            f"-I{INCLUDE_DIR}",
            f"-I{source.parent}",
            *[f"-I{d}" for d in include_dirs],
            "-include",
            str(SHIM_HEADER),
        ]
    )
    # The kernel file and every header it could include: editing any rebuilds.
    headers = [
        path
        for folder in (source.parent, *include_dirs, INCLUDE_DIR)
        for pattern in ("*.cuh", "*.h")
        for path in sorted(folder.glob(pattern))
    ]
    return build_shared_library(
        "emulator",
        source.stem,
        wrapper_source(source, name_expressions),
        [source, *headers],
        os.environ.get("CXX", "g++"),
        flags,
        "the CUDA emulator",
    )
