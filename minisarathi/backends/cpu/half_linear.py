"""The CPU's matmul for weights kept in 16 bits (bfloat16 or float16): half_linear.cpp, compiled at first use.

A bf16 or fp16 weight widened to float32 takes 4 bytes a weight; kept as it is, 2, so a decode step, which
reads every weight once, reads half the bytes. The kernel widens the weights in registers (a shift for bf16,
F16C for fp16) and multiplies in float32, with an AVX-512 or an AVX2 + FMA + F16C path chosen at run time and
a scalar one elsewhere; all three compute each output by the same chain of multiply-adds, so they agree bit
for bit. Where no library can be built (no C++ compiler, MINISARATHI_HALF_LINEAR=0), `matmul` widens the
weight and uses NumPy's matmul: the same numbers within float32 rounding, slower, the same memory.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minisarathi.backends.cpu.native import load_cpu_library
from minisarathi.backends.cpu.process_setup import kernel_threads
from minisarathi.dtypes import DTYPES, convert, dtype_name, to_float32
from minisarathi.model.loader import CheckpointTensor

SOURCE = Path(__file__).resolve().parent / "half_linear.cpp"
# No -mavx512f: each path has its target attribute and is chosen at run time. No -ffast-math and no
# contraction: the order of each output's multiply-adds is what makes the paths and the batches agree.
FLAGS = [
    "-std=c++17",
    "-O3",
    "-ffp-contract=off",
    "-shared",
    "-fPIC",
    "-fvisibility=hidden",
    "-Wall",
    "-Wl,-z,defs",
    "-fopenmp",
]
LANES = 16  # outputs per panel (the kernel's LANES)
FORMATS = {"bfloat16": 0, "float16": 1}  # the kernel's enum Format
ISAS = {"scalar": 1, "avx2": 2, "avx512": 3}  # the kernel's enum Isa

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class HalfWeight:
    """A weight w[N, K] in 16 bits, in panels of 16 outputs as the kernel reads them."""

    panels: np.ndarray  # uint16[ceil(N / 16), K, 16] (bf16 bits or fp16 bits), C order, 64-byte aligned
    dtype: str  # "bfloat16" or "float16"
    out_features: int  # N; outputs past it in the last panel are zeros
    address: int  # of panels' data, read once (.ctypes.data is slow)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.panels.shape[1]

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    def _values(self, rows: np.ndarray) -> np.ndarray:
        """float32 values of 16-bit storage (uint16 bits) in self.dtype, exact."""
        return to_float32(rows if self.dtype == "bfloat16" else rows.view(np.float16), self.dtype)

    def widen(self) -> np.ndarray:
        """float32[N, K], exact."""
        n, k = self.shape
        return self._values(self.panels.transpose(0, 2, 1).reshape(-1, k)[:n])

    def take(self, ids, axis=None, out=None, mode="raise") -> np.ndarray:
        """float32[T, K]: rows `ids` widened. np.take(w, ids, axis=0) calls this, so CpuOps.embedding
        gathers a 16-bit table's rows without widening the table."""
        if axis != 0 or out is not None or mode != "raise":
            raise ValueError("a HalfWeight's rows are taken along axis 0, without out or mode")
        ids = np.asarray(ids)
        if ids.size and not (0 <= ids.min() and ids.max() < self.out_features):
            raise IndexError(f"row ids must be in [0, {self.out_features}), got {ids.min()}..{ids.max()}")
        return self._values(self.panels[ids // LANES, :, ids % LANES])


def check_dtype(dtype: str) -> str:
    """`dtype` if it is one of DTYPES (CpuOps' weight dtype), else ValueError."""
    if dtype not in DTYPES:
        raise ValueError(f"the CPU's weight dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def keeps(array: CheckpointTensor | np.ndarray, dtype: str) -> bool:
    """Whether CpuOps with weight dtype `dtype` keeps `array` in 16 bits: a 2-D floating-point weight (a
    linear weight or the embedding table), not a quantized one. Norms and biases stay float32."""
    floating = not isinstance(array, CheckpointTensor) or array.dtype in DTYPES
    return dtype in FORMATS and len(array.shape) == 2 and floating


def half_weight(array: CheckpointTensor | np.ndarray, dtype: str) -> HalfWeight:
    """`array` (a float32, float16 or bfloat16 CheckpointTensor, or an array: float32, float16, or uint16
    bfloat16 bits) [N, K] as a HalfWeight in `dtype`, rounded to the nearest even where it is wider."""
    if dtype not in FORMATS:
        raise ValueError(f"a HalfWeight's dtype must be bfloat16 or float16, got {dtype!r}")
    source, data = (array.dtype, array.data) if isinstance(array, CheckpointTensor) else (None, array)
    source = source or dtype_name(data)
    if len(data.shape) != 2:
        raise ValueError(f"a HalfWeight is a matrix, got a {source} tensor of shape {list(data.shape)}")
    stored = convert(data, source, dtype)  # uint16 bf16 bits or float16, [N, K]
    if source != dtype and not np.array_equal(
        np.isfinite(to_float32(stored, dtype)), np.isfinite(to_float32(data, source))
    ):
        raise ValueError(
            f"a {source} weight of shape {list(data.shape)} has values beyond {dtype}'s range "
            f"(largest magnitude {np.abs(to_float32(data, source)).max()}); use another dtype"
        )
    bits = stored.view(np.uint16)
    n, k = bits.shape
    panels = -(-n // LANES)
    # 64-byte aligned, so a panel's row of 16 weights never splits a cache line
    raw = np.empty(panels * k * LANES + 32, dtype=np.uint16)
    start = (-raw.ctypes.data % 64) // 2
    packed = raw[start : start + panels * k * LANES].reshape(panels, k, LANES)  # uint16[P, K, 16]
    full = n // LANES
    packed[:full] = bits[: full * LANES].reshape(full, LANES, k).transpose(0, 2, 1)
    if full < panels:
        packed[full] = 0
        packed[full, :, : n - full * LANES] = bits[full * LANES :].T
    return HalfWeight(packed, dtype, n, packed.ctypes.data)


class HalfLinear:
    """The loaded library."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.lib.half_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, *[ctypes.c_int] * 3]
        self.lib.half_linear.restype = ctypes.c_int
        self.best_isa = {v: k for k, v in ISAS.items()}[self.lib.half_linear_best_isa()]

    def matmul(
        self, x: np.ndarray, w: HalfWeight, isa: str | None = None, threads: int | None = None
    ) -> np.ndarray:
        """float32[M, N] = x[M, K] @ w.T, C order. isa: "avx512", "avx2" or "scalar" to force a path
        (ValueError where this CPU lacks it); None: the widest this CPU runs. threads: None for
        kernel_threads()."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        m, k = x.shape
        if k != w.shape[1]:
            raise ValueError(f"x: {k} input features, the weight takes {w.shape[1]}")
        out = np.empty((m, w.out_features), dtype=np.float32)
        code = 0 if isa is None else ISAS[isa]
        threads = kernel_threads() if threads is None else threads
        ran = self.lib.half_linear(
            x.ctypes.data, m, k, w.address, w.out_features, out.ctypes.data, FORMATS[w.dtype], code, threads
        )
        if ran < 0:
            raise ValueError(f"half_linear: this CPU cannot run the {isa} path")
        return out


@functools.cache
def kernel() -> HalfLinear | None:
    """The library, built at first use; None where it cannot be (the log says why). CDLL: a matmul of many
    rows runs milliseconds, which the server's event loop may use meanwhile."""
    lib = load_cpu_library(SOURCE, FLAGS, "16-bit matmul", "MINISARATHI_HALF_LINEAR", hold_gil=False, log=log)
    return None if lib is None else HalfLinear(lib)


def matmul(x: np.ndarray, w: HalfWeight) -> np.ndarray:
    """float32[M, N] = x[M, K] @ w.T: the kernel, or NumPy on the widened weight where it is off."""
    native = kernel()
    if native is None:
        return np.asarray(x, dtype=np.float32) @ w.widen().T
    return native.matmul(x, w)
