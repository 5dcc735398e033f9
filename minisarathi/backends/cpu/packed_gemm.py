"""The CPU's weight matmul with weights packed once at load: packed_gemm.cpp, compiled at first use (ctypes).

NumPy's `x @ w.T` hands OpenBLAS the weight as it is stored, and OpenBLAS repacks it on every call; this
kernel reads panels packed once. It has an AVX-512 and an AVX2 + FMA path, the widest this CPU runs chosen at
load, and needs a C++ compiler (CXX, default g++) the first time; the library is cached by content
(minisarathi/backends/cpu/native.py). Where the CPU has neither, no compiler, or MINISARATHI_PACKED_GEMM=0 is
set (to measure against NumPy), `kernel()` is None and CpuOps keeps NumPy's matmul. The kernel runs the
engine's thread count (process_setup.kernel_threads); weights are packed only where BLAS runs one thread
(`packs`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minisarathi.backends.cpu.native import AVX2, cpu_library_path, load_cpu_library
from minisarathi.backends.cpu.process_setup import blas_threads_in_force, kernel_threads

SOURCE = Path(__file__).resolve().parent / "packed_gemm.cpp"
# No -ffast-math: each output's chain of multiply-adds must stay in k order (determinism, see the source).
# No -mavx512f: each path has its target attribute and is chosen at run time.
FLAGS = ["-std=c++17", "-O3", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wl,-z,defs", "-fopenmp"]

# Weights shallower than this (K) are not packed: the fixed costs of a call from Python and of a register tile
# (24 accumulators loaded and stored) outweigh its few k steps, and they lose to NumPy at every row count.
MIN_IN_FEATURES = 256
ISAS = {"avx2": 2, "avx512": 3}  # the kernel's enum Isa

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedWeight:
    """A weight w[N, K] as the kernel reads it."""

    panels: np.ndarray  # float32[ceil(N / NR), K, NR], C order, 64-byte aligned; features past N are zeros
    out_features: int  # N
    address: int  # of panels' data, read once (.ctypes.data is slow)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.panels.shape[1]

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes


class PackedGemm:
    """The loaded library's path `isa` ("avx512" or "avx2"; None: the widest this CPU runs), whose panel width
    (NR) its packed weights have: weights packed for one path are not read by another."""

    def __init__(self, lib: ctypes.CDLL, isa: str | None = None):
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        lib.packed_gemm.argtypes = [i32, ptr, i64, i64, i64, ptr, i64, ptr, i64, i32]
        lib.packed_gemm.restype = i32
        lib.packed_gemm_panel_width.argtypes = [i32]
        best = lib.packed_gemm_best_isa()
        if isa is None:
            isa = {v: k for k, v in ISAS.items()}[best]
        elif ISAS[isa] > best:
            raise ValueError(f"packed_gemm: this CPU cannot run the {isa} path")
        self.lib, self.isa, self._code = lib, isa, ISAS[isa]
        self.panel_width = lib.packed_gemm_panel_width(self._code)  # NR

    def pack(self, w: np.ndarray) -> PackedWeight:
        """w: float32[N, K]."""
        n, k = w.shape
        nr = self.panel_width
        panels = -(-n // nr)
        # 64-byte aligned, so a panel row (NR floats) is whole cache lines and never splits a vector load
        raw = np.empty(panels * k * nr + 16, dtype=np.float32)
        start = (-raw.ctypes.data % 64) // 4
        packed = raw[start : start + panels * k * nr].reshape(panels, k, nr)  # float32[panels, K, NR]
        full = n // nr
        packed[:full] = w[: full * nr].reshape(full, nr, k).transpose(0, 2, 1)
        if full < panels:
            packed[full] = 0
            packed[full, :, : n - full * nr] = w[full * nr :].T
        return PackedWeight(packed, n, packed.ctypes.data)

    def matmul(self, x: np.ndarray, w: PackedWeight, threads: int | None = None) -> np.ndarray:
        """float32[M, N] = x[M, K] @ w.T, C order. threads: None, kernel_threads()."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        m, k = x.shape
        if k != w.panels.shape[1]:
            raise ValueError(f"x: {k} input features, the weight takes {w.panels.shape[1]}")
        if w.panels.shape[2] != self.panel_width:
            raise ValueError(
                f"w: packed in panels of {w.panels.shape[2]}, the {self.isa} path reads {self.panel_width}"
            )
        out = np.empty((m, w.out_features), dtype=np.float32)
        status = self.lib.packed_gemm(
            self._code,
            x.ctypes.data,
            m,
            k,
            k,
            w.address,
            w.out_features,
            out.ctypes.data,
            w.out_features,
            kernel_threads() if threads is None else threads,
        )
        if status == -1:
            raise MemoryError(f"packed_gemm: no memory for the input tiles of {m} x {k}")
        if status:
            raise ValueError(f"packed_gemm: this CPU cannot run the {self.isa} path")
        return out


def packs(in_features: int) -> bool:
    """The rule for which weights CpuOps packs: where the kernel runs here, the weight is at least
    MIN_IN_FEATURES deep, and BLAS runs one thread (EngineConfig.blas_threads = 1, or the auto rule's 1 on a
    busy or pinned machine). Where NumPy may use several cores, its matmul is kept: the kernel on several
    threads against multi-threaded BLAS is not yet measured."""
    return in_features >= MIN_IN_FEATURES and blas_threads_in_force() == 1 and kernel() is not None


def library_path() -> Path:
    """packed_gemm.cpp built for this CPU (cached); RuntimeError or OSError where it cannot be."""
    return cpu_library_path(SOURCE, FLAGS, "the packed matmul")


@functools.cache
def kernel() -> PackedGemm | None:
    """The library for this CPU, built at first use; None where it cannot run here (the log says why). CDLL:
    a matmul of many rows runs milliseconds, which the server's event loop may use meanwhile."""
    lib = load_cpu_library(
        SOURCE, FLAGS, "packed matmul", "MINISARATHI_PACKED_GEMM", needs=AVX2, hold_gil=False, log=log
    )
    if lib is None:
        return None
    gemm = PackedGemm(lib)
    log.info("packed matmul: the %s path, panels of %d outputs", gemm.isa, gemm.panel_width)
    return gemm
