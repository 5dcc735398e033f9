"""Compiles C++ into a shared library in a per-user cache, named by a hash of everything that goes into it.

Used by the CUDA emulator (every .cu file) and the fast CPU backend's native kernels (through
minisarathi/backends/cpu/native.py). A library is built once per content, compiler and flags; later processes
find it by name. Threads and processes that want the same library at once (replicas, tensor-parallel ranks,
test workers) wait for one build: a thread lock, then an flock on <library>.lock; the build goes to a unique
temporary name renamed into place atomically, so a reader never sees half a library.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

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
        raise RuntimeError(
            f"no cache folder for compiled libraries ({base / kind} cannot be written): {exc}"
        ) from exc
    return path


def check_private_dir(path: Path) -> None:
    """Raises RuntimeError unless `path` is a real directory of this user that no one else can write: in a
    shared temporary folder, another user could have made it first and planted a library we would load."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(
            f"cache folder {path} is not a directory of this user writable only by it "
            f"(mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}): not loading "
            f"libraries from it; set MINISARATHI_CACHE_DIR to a private folder"
        )


def build_shared_library(
    kind: str,
    stem: str,
    translation_unit: str,
    inputs: list[Path],
    compiler: str,
    flags: list[str],
    purpose: str,
) -> Path:
    """The path of `translation_unit` (C++ text) compiled with `compiler` and `flags` into <stem>-<hash>.so
    under cache_dir(kind). inputs: the files it includes, whose bytes go into the hash (editing one rebuilds).
    purpose names the user of the library in errors ("the CUDA emulator"). compiler is a command line, as CXX
    ("ccache g++"). Raises RuntimeError when the compiler is missing or fails, or no safe cache folder
    exists."""
    digest = hashlib.sha256()
    for part in (translation_unit, " ".join(flags), compiler):
        digest.update(part.encode() + b"\0")
    for path in inputs:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    out_dir = cache_dir(kind)
    target = out_dir / f"{stem}-{digest.hexdigest()[:20]}.so"
    with _locks_guard:
        lock = _locks.setdefault(target, threading.Lock())
    with lock:  # one build per target in this process; other libraries build in parallel
        if target.exists():
            return target
        with open(f"{target}.lock", "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released when closed, also if this process dies
            if not target.exists():  # another process built it while this one waited
                _compile(translation_unit, stem, out_dir, target, compiler, flags, purpose)
    return target


def _compile(
    translation_unit: str,
    stem: str,
    out_dir: Path,
    target: Path,
    compiler: str,
    flags: list[str],
    purpose: str,
) -> None:
    """Compiles into a temporary name in out_dir, then renames it to target."""
    fd, tmp_cpp = tempfile.mkstemp(suffix=".cpp", prefix=stem + "-", dir=out_dir)
    with os.fdopen(fd, "w") as f:
        f.write(translation_unit)
    tmp_so = tmp_cpp[:-4] + ".so"
    try:
        cmd = [*shlex.split(compiler), *flags, "-x", "c++", tmp_cpp, "-o", tmp_so]  # CXX="ccache g++"
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
