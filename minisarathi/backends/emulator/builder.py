"""Builds a .cu file with g++ against the emulator's shim header into a shared library, cached by content."""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
SHIM_HEADER = INCLUDE_DIR / "minisarathi_emu.h"

# -fno-extern-tls-init: `extern __shared__` becomes an extern thread_local; without it every access
# would go through a TLS wrapper call. -z defs: an unresolved symbol fails at build, not at dlopen.
FLAGS = ["-std=c++20", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing", "-fno-extern-tls-init",
         "-fvisibility=hidden", "-Wall", "-Wno-unused-function", "-Wno-unused-variable", "-Wl,-z,defs"]

_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


def optimization_flags() -> list[str]:
    # MINISARATHI_EMU_DEBUG=1 builds for stepping through a kernel in gdb (no inlining, no reordering).
    return ["-O0", "-g3"] if os.environ.get("MINISARATHI_EMU_DEBUG") == "1" else ["-O1", "-g"]


def cache_dir() -> Path:
    configured = os.environ.get("MINISARATHI_CACHE_DIR")
    base = Path(configured) if configured else Path.home() / ".cache" / "minisarathi"
    path = base / "emulator"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    path = Path(tempfile.gettempdir()) / f"minisarathi-emulator-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def wrapper_source(source: Path, name_expressions: list[str]) -> str:
    """The translation unit g++ compiles: the .cu file plus, per kernel, a launch stub and its signature."""
    lines = [f'#include "{source}"', ""]
    for i, expr in enumerate(name_expressions):
        lines += [
            f'extern "C" __attribute__((visibility("default"))) int minisarathi_emu_launch_{i}('
            f"const emu::LaunchArgs* cfg, void** args, char* error, int error_len) {{",
            f"    return emu::launch(&{expr}, cfg, args, error, error_len);",
            "}",
            f'extern "C" __attribute__((visibility("default"))) const char* minisarathi_emu_signature_{i}() {{',
            f"    return emu::signature(&{expr});",
            "}",
        ]
    return "\n".join(lines) + "\n"


def _fingerprint(source: Path, include_dirs: list[Path], wrapper: str, flags: list[str], compiler: str) -> str:
    digest = hashlib.sha256()
    for part in (wrapper, " ".join(flags), compiler):
        digest.update(part.encode() + b"\0")
    # The kernel file and every header it could include: editing any rebuilds.
    headers = [path for folder in (source.parent, *include_dirs, INCLUDE_DIR)
               for pattern in ("*.cuh", "*.h") for path in sorted(folder.glob(pattern))]
    for path in [source, *headers]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def build(source: str | Path, name_expressions: list[str], include_dirs: list[str | Path] = ()) -> Path:
    """Returns the path of the shared library for `source` exporting one launch stub per name expression.
    Headers are searched beside the source, then in include_dirs."""
    source = Path(source).resolve()
    include_dirs = [Path(d).resolve() for d in include_dirs]
    if not source.is_file():
        raise ValueError(f"source: no such kernel file {source}")
    if not name_expressions:
        raise ValueError("name_expressions: give at least one kernel name")
    compiler = os.environ.get("CXX", "g++")
    flags = FLAGS + optimization_flags() + [f"-I{INCLUDE_DIR}", f"-I{source.parent}",
                                                   *[f"-I{d}" for d in include_dirs], "-include", str(SHIM_HEADER)]
    wrapper = wrapper_source(source, name_expressions)
    out_dir = cache_dir()
    target = out_dir / f"{source.stem}-{_fingerprint(source, include_dirs, wrapper, flags, compiler)}.so"
    with _locks_guard:
        lock = _locks.setdefault(target, threading.Lock())
    with lock:   # one build per target in this process; other files build in parallel
        if target.exists():
            return target
        # Unique temporary names, then an atomic rename: safe when threads or processes race.
        fd, tmp_cpp = tempfile.mkstemp(suffix=".cpp", prefix=source.stem + "-", dir=out_dir)
        with os.fdopen(fd, "w") as f:
            f.write(wrapper)
        tmp_so = tmp_cpp[:-4] + ".so"
        try:
            cmd = [compiler, *flags, "-x", "c++", tmp_cpp, "-o", tmp_so]
            try:
                result = subprocess.run(cmd, capture_output=True, text=True)
            except FileNotFoundError as exc:
                raise RuntimeError(f"the CUDA emulator needs a C++ compiler ({compiler!r} not found; set CXX)") from exc
            if result.returncode != 0:
                raise RuntimeError(f"emulator build of {source.name} failed:\n{' '.join(cmd)}\n{result.stderr}")
            os.replace(tmp_so, target)
        finally:
            for leftover in (tmp_cpp, tmp_so):
                if os.path.exists(leftover) and leftover != str(target):
                    os.unlink(leftover)
    return target
