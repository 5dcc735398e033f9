"""How the CPU backend's native kernels (packed_gemm.cpp, half_linear.cpp, quant_linear.cpp,
native_attention.cpp, native_sampling.cpp) are built for this CPU, loaded, or turned off: their one way,
over minisarathi/backends/native_build.py."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

from minisarathi.backends.cpu.process_setup import cpu_flags
from minisarathi.backends.native_build import build_shared_library

# The CPU flags (as /proc/cpuinfo names them) of the narrowest vector path of packed_gemm.cpp and
# native_attention.cpp; each also has an AVX-512 path, chosen in the library at run time where the CPU has it.
AVX2 = frozenset({"avx2", "fma"})


def cpu_library_path(source: Path, flags: list[str], purpose: str) -> Path:
    """`source` (a .cpp file) built with CXX (default g++) and `flags` for this CPU (cached); RuntimeError or
    OSError where it cannot be. The headers beside it go into the cache key: a kernel may include them."""
    return build_shared_library(
        "cpu_kernels",
        source.stem,
        f'#include "{source}"\n',
        [source, *sorted(source.parent.glob("*.h"))],
        os.environ.get("CXX", "g++"),
        flags,
        purpose,
    )


def load_cpu_library(
    source: Path,
    flags: list[str],
    name: str,
    switch: str,
    hold_gil: bool,
    log: logging.Logger,
    needs: frozenset[str] = frozenset(),
) -> ctypes.CDLL | None:
    """A CPU-backend kernel's library, built at first use and loaded; None where it cannot run here, `log`
    saying why ("NAME off ..."): the environment variable `switch` set to 0 (to measure against NumPy), a CPU
    without one of the flags `needs` (those every path of the library needs: AVX2, or none), no compiler or
    a failed build, no safe cache folder, a library that cannot be loaded (a noexec mount, a corrupt cached
    file). The caller then keeps its NumPy code.
    hold_gil: load with ctypes.PyDLL, whose calls keep the GIL: a call of a few us that released it (CDLL)
    could hand the GIL to the server's event loop and wait for it back."""
    if os.environ.get(switch) == "0":
        return None
    if needs:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                features = cpu_flags(f.read(1 << 16))
        except OSError:
            features = frozenset()
        if not needs <= features:
            log.info("%s off: the CPU has no %s; NumPy's instead", name, " + ".join(sorted(needs - features)))
            return None
    try:
        path = cpu_library_path(source, flags, f"the {name}")
        return (ctypes.PyDLL if hold_gil else ctypes.CDLL)(str(path))
    except (RuntimeError, OSError) as exc:
        log.warning("%s off, NumPy's instead: %s", name, exc)
        return None
