"""The CPU's matmul for Q8_0 weights kept as int8 values and a scale per group of 32: q8_linear.cpp,
compiled at first use (ctypes).

A Q8_0 weight in float32 takes 4 bytes a weight; here it takes 1 + 4/32 (the float32 scale of each group), so
a decode step, which reads every weight once, reads about a quarter of the bytes. The kernel widens the
weights in registers, with an AVX-512 or an AVX2 + FMA path chosen at run time and a scalar one elsewhere.
Where no library can be built (no C++ compiler, MINISARATHI_Q8_LINEAR=0), `matmul` dequantizes the weight
and uses NumPy's matmul: the same numbers within float32 rounding, slower, and still a quarter of the memory.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minisarathi.backends.cpu.native import load_cpu_library
from minisarathi.quant.layouts import IntGroups

SOURCE = Path(__file__).resolve().parent / "q8_linear.cpp"
# No -mavx512f: each path has its target attribute and is chosen at run time. No -ffast-math: the order of
# each output's multiply-adds is what makes a row's result independent of its batch.
FLAGS = ["-std=c++17", "-O3", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wl,-z,defs"]
GROUP = 32
ISAS = {"scalar": 1, "avx2": 2, "avx512": 3}  # the kernel's enum Isa

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Q8Weight:
    """A Q8_0 weight w[N, K] = scale (per group of 32 columns) * values, as the kernel reads it."""

    values: np.ndarray  # int8[N, K], C order
    scale: np.ndarray  # float32[N, K // 32], C order
    addresses: tuple[int, int]  # of values' and scale's data, read once (.ctypes.data is slow)

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes

    def dequantize(self) -> np.ndarray:
        """float32[N, K], exact: an fp16 scale times an int8 is a float32 without rounding."""
        n, k = self.values.shape
        return (self.values.reshape(n, k // GROUP, GROUP) * self.scale[:, :, None]).reshape(n, k)


def runs(layout) -> bool:
    """Whether the kernel reads this layout: a matrix of 8-bit integers in groups of 32 (Q8_0, and GPTQ's
    8-bit symmetric form)."""
    return isinstance(layout, IntGroups) and (layout.bits, layout.group, len(layout.shape)) == (8, GROUP, 2)


def q8_weight(layout: IntGroups) -> Q8Weight:
    """The kernel's form of an 8-bit, group-32 IntGroups layout [N, K] (its scales widened to float32)."""
    if not runs(layout):
        raise ValueError(f"an 8-bit matrix in groups of 32 is needed, got {layout.source} {layout.shape}")
    values = np.ascontiguousarray(layout.values, dtype=np.int8)
    scale = np.ascontiguousarray(layout.scale, dtype=np.float32)
    return Q8Weight(values, scale, (values.ctypes.data, scale.ctypes.data))


class Q8Linear:
    """The loaded library."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.lib.q8_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
        self.lib.q8_linear.restype = ctypes.c_int
        self.best_isa = {v: k for k, v in ISAS.items()}[self.lib.q8_linear_best_isa()]

    def matmul(self, x: np.ndarray, w: Q8Weight, isa: str | None = None) -> np.ndarray:
        """float32[M, N] = x[M, K] @ w.T, C order. isa: "avx512", "avx2" or "scalar" to force a path
        (ValueError where this CPU lacks it); None: the widest this CPU runs."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        m, k = x.shape
        n = w.values.shape[0]
        if k != w.values.shape[1]:
            raise ValueError(f"x: {k} input features, the weight takes {w.values.shape[1]}")
        out = np.empty((m, n), dtype=np.float32)
        code = 0 if isa is None else ISAS[isa]
        if self.lib.q8_linear(x.ctypes.data, m, k, *w.addresses, n, out.ctypes.data, code) < 0:
            raise ValueError(f"q8_linear: this CPU cannot run the {isa} path")
        return out


@functools.cache
def kernel() -> Q8Linear | None:
    """The library, built at first use; None where it cannot be (the log says why). CDLL: a matmul of many
    rows runs milliseconds, which the server's event loop may use meanwhile."""
    lib = load_cpu_library(SOURCE, FLAGS, "Q8_0 matmul", "MINISARATHI_Q8_LINEAR", hold_gil=False, log=log)
    return None if lib is None else Q8Linear(lib)


def matmul(x: np.ndarray, w: Q8Weight) -> np.ndarray:
    """float32[M, N] = x[M, K] @ w.T: the kernel, or NumPy on the dequantized weight where it is off."""
    native = kernel()
    if native is None:
        return np.asarray(x, dtype=np.float32) @ w.dequantize().T
    return native.matmul(x, w)
