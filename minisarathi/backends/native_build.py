"""Compiles C++ into a shared library in a per-user cache, named by a hash of everything that goes into it.

Used by the CUDA emulator (every .cu file) and the NumPy backend's native kernels (packed_gemm.cpp,
cpu_attention.cpp, cpu_sampling.cpp: load_cpu_library, their one way to be built, loaded or turned off). A library is built once per content, compiler and flags; later processes find it by name.
Threads and processes that race to build the same library each compile to a unique temporary name and rename it
into place atomically.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

from minisarathi.backends.cpu_setup import cpu_flags

_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


def cache_dir(kind: str) -> Path:
    """$MINISARATHI_CACHE_DIR/<kind> (default ~/.cache/minisarathi/<kind>), or a temporary folder where that
    cannot be written. Raises RuntimeError when the temporary folder is not safe to load libraries from."""
    configured = os.environ.get("MINISARATHI_CACHE_DIR")
    base = Path(configured) if configured else Path.home() / ".cache" / "minisarathi"
    path = base / kind
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    path = Path(tempfile.gettempdir()) / f"minisarathi-{kind}-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        check_private_dir(path)
    except OSError as exc:
        raise RuntimeError(f"no cache folder for compiled libraries ({base / kind} cannot be written): {exc}") \
            from exc
    return path


def check_private_dir(path: Path) -> None:
    """Raises RuntimeError unless `path` is a real directory of this user that no one else can write: in a
    shared temporary folder, another user could have made it first and planted a library that we would load."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"cache folder {path} is not a directory of this user writable only by it "
                           f"(mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}): not loading libraries "
                           f"from it; set MINISARATHI_CACHE_DIR to a private folder")


def build_shared_library(kind: str, stem: str, translation_unit: str, inputs: list[Path], compiler: str,
                         flags: list[str], purpose: str) -> Path:
    """The path of `translation_unit` (C++ text) compiled with `compiler` and `flags` into <stem>-<hash>.so under
    cache_dir(kind). inputs: the files it includes, whose bytes go into the hash (editing one rebuilds).
    purpose names the user of the library in errors ("the CUDA emulator"). compiler is a command line, as CXX
    ("ccache g++"). Raises RuntimeError when the compiler is missing or fails, or no safe cache folder exists."""
    digest = hashlib.sha256()
    for part in (translation_unit, " ".join(flags), compiler):
        digest.update(part.encode() + b"\0")
    for path in inputs:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    out_dir = cache_dir(kind)
    target = out_dir / f"{stem}-{digest.hexdigest()[:20]}.so"
    with _locks_guard:
        lock = _locks.setdefault(target, threading.Lock())
    with lock:   # one build per target in this process; other libraries build in parallel
        if target.exists():
            return target
        fd, tmp_cpp = tempfile.mkstemp(suffix=".cpp", prefix=stem + "-", dir=out_dir)
        with os.fdopen(fd, "w") as f:
            f.write(translation_unit)
        tmp_so = tmp_cpp[:-4] + ".so"
        try:
            cmd = [*shlex.split(compiler), *flags, "-x", "c++", tmp_cpp, "-o", tmp_so]   # CXX="ccache g++"
            try:
                result = subprocess.run(cmd, capture_output=True, text=True)
            except FileNotFoundError as exc:
                raise RuntimeError(f"{purpose} needs a C++ compiler ({compiler!r} not found; set CXX)") from exc
            if result.returncode != 0:
                raise RuntimeError(f"{purpose}: build of {stem} failed:\n{' '.join(cmd)}\n{result.stderr}")
            os.replace(tmp_so, target)
        finally:
            for leftover in (tmp_cpp, tmp_so):
                if os.path.exists(leftover) and leftover != str(target):
                    os.unlink(leftover)
    return target


def cpu_library_path(source: Path, flags: list[str], purpose: str) -> Path:
    """`source` (a .cpp file) built with CXX (default g++) and `flags` for this CPU (cached); RuntimeError or
    OSError where it cannot be."""
    return build_shared_library("cpu_kernels", source.stem, f'#include "{source}"\n', [source],
                                os.environ.get("CXX", "g++"), flags, purpose)


def load_cpu_library(source: Path, flags: list[str], name: str, switch: str, needs_avx512: bool, hold_gil: bool,
                     log: logging.Logger) -> ctypes.CDLL | None:
    """A NumPy-backend kernel's library, built at first use and loaded; None where it cannot run here, `log`
    saying why ("NAME off ..."): the environment variable `switch` set to 0 (to measure against NumPy), a CPU
    without AVX-512 where the kernel needs it, no compiler or a failed build, no safe cache folder, a library that
    cannot be loaded (a noexec mount, a corrupt cached file). The caller then keeps its NumPy code.
    hold_gil: load with ctypes.PyDLL, whose calls keep the GIL: a call of a few us that released it (CDLL) could
    hand the GIL to the server's event loop and wait for it back."""
    if os.environ.get(switch) == "0":
        return None
    if needs_avx512:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                features = cpu_flags(f.read(1 << 16))
        except OSError:
            features = frozenset()
        if "avx512f" not in features:
            log.info("%s off: the CPU has no AVX-512; NumPy's instead", name)
            return None
    try:
        path = cpu_library_path(source, flags, f"the {name}")
        return (ctypes.PyDLL if hold_gil else ctypes.CDLL)(str(path))
    except (RuntimeError, OSError) as exc:
        log.warning("%s off, NumPy's instead: %s", name, exc)
        return None
