"""The sampler's inverse CDF in one native call: native_sampling.cpp, compiled at first use, via ctypes; and
the bitmask of structured outputs applied to logits (minisarathi/structured.py).

Sampler._inverse_cdf in NumPy costs a few dozen array calls and a float64 reduction per block of every row;
the kernel picks the same tokens, bit for bit, in one call. It needs a C++ compiler (CXX, default g++) the
first time; the library is cached by content (minisarathi/backends/cpu/native.py). Where it cannot be built,
or MINISARATHI_CPU_SAMPLING=0 is set (to measure against NumPy), `kernel()` is None and the Sampler keeps
NumPy's.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np

from minisarathi.backends.cpu.native import cpu_library_path, load_cpu_library

SOURCE = Path(__file__).resolve().parent / "native_sampling.cpp"
# No -ffast-math, no FMA contraction: every float64 operation must round as NumPy's does (see the source).
FLAGS = [
    "-std=c++17",
    "-O2",
    "-ffp-contract=off",
    "-shared",
    "-fPIC",
    "-fvisibility=hidden",
    "-Wall",
    "-Wl,-z,defs",
]

log = logging.getLogger(__name__)


class InverseCdf:
    """The kernel for one vocabulary size and block size."""

    def __init__(self, function, vocab_size: int, block: int):
        self._function = function  # the library's inverse_cdf
        self.vocab_size, self.block = vocab_size, block
        self._out = np.empty(0, np.int64)  # the tokens, written in place (.ctypes.data is slow)
        self._out_address = self._out.ctypes.data

    def __call__(self, probs: np.ndarray, u: np.ndarray) -> np.ndarray:
        """int64[R]: Sampler._inverse_cdf(probs, u) for probs float32[R, vocab] (>= 0, each row with mass), u
        float64[R] in [0, 1)."""
        probs = np.ascontiguousarray(probs, dtype=np.float32)
        u = np.ascontiguousarray(u, dtype=np.float64)
        rows = len(probs)
        if probs.shape != (rows, self.vocab_size) or u.shape != (rows,):
            raise ValueError(
                f"probs must be [R, {self.vocab_size}] and u [R], got {probs.shape} and {u.shape}"
            )
        if len(self._out) < rows:
            self._out = np.empty(2 * rows, np.int64)
            self._out_address = self._out.ctypes.data
        self._function(probs.ctypes.data, rows, self.vocab_size, self.block, u.ctypes.data, self._out_address)
        return self._out[:rows].copy()


def library_path() -> Path:
    """native_sampling.cpp built (cached); RuntimeError or OSError where it cannot be."""
    return cpu_library_path(SOURCE, FLAGS, "the native inverse CDF")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Called with the GIL held: the call takes a few us, and releasing the GIL around it could hand it to the
    server's event loop and hold the engine thread up. Needs no AVX-512 (plain float64 arithmetic)."""
    lib = load_cpu_library(
        SOURCE,
        FLAGS,
        "native inverse CDF",
        "MINISARATHI_CPU_SAMPLING",
        hold_gil=True,
        log=log,
    )
    if lib is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.inverse_cdf.argtypes = [ptr, i64, i64, i64, ptr, ptr]
        lib.inverse_cdf.restype = None
        lib.apply_token_bitmask.argtypes = [ptr, i64, ptr, i64, ptr, i64]
        lib.apply_token_bitmask.restype = None
    return lib


def kernel(vocab_size: int, block: int) -> InverseCdf | None:
    """The inverse CDF for rows of vocab_size tokens in blocks of `block`, the library built at first use;
    None where it cannot be (the log says why) or is turned off."""
    lib = _library()
    return None if lib is None else InverseCdf(lib.inverse_cdf, vocab_size, block)


class TokenBitmask:
    """apply_token_bitmask of native_sampling.cpp: in place, with the GIL held (a few us a row)."""

    def __init__(self, function):
        self._function = function

    def __call__(self, logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> None:
        """Sets to -inf, in C-ordered float32 logits [N, V], the tokens int32 bitmask[i] clears in row
        rows[i] (int64[R], each in [0, N)); bitmask is [R, ceil(V / 32)]."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        bitmask = np.ascontiguousarray(bitmask, dtype=np.int32)
        n, vocab = logits.shape
        if logits.dtype != np.float32 or not logits.flags.c_contiguous:
            raise ValueError("logits must be C-ordered float32")
        if bitmask.shape != (len(rows), (vocab + 31) // 32) or (
            rows.size and not 0 <= rows.min() <= rows.max() < n
        ):
            raise ValueError(f"bitmask must be [{len(rows)}, {(vocab + 31) // 32}] and rows in [0, {n})")
        self._function(
            logits.ctypes.data, vocab, rows.ctypes.data, len(rows), bitmask.ctypes.data, bitmask.shape[1]
        )


@functools.cache
def token_bitmask_kernel() -> TokenBitmask | None:
    """The bitmask kernel, the library built at first use; None where it cannot be, or is turned off."""
    lib = _library()
    return None if lib is None else TokenBitmask(lib.apply_token_bitmask)
