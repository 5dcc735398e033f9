"""The CPU's matmul for quantized weights kept compact: quant_linear.cpp, compiled at first use (ctypes).

Every quantized matrix layout (minisarathi/quant/layouts.py) is kept in a form close to its file's bytes and
multiplied there: IntGroups of 8 bits (Q8_0, GPTQ-8) as int8 values and a float32 scale per 16 or 32
columns; IntGroups of 6 bits (Q6_K) as 4 + 2 bits a weight and a scale per 16; UintGroups (Q4_0, Q4_K, Q5_K,
AWQ, GPTQ-4) as their nibbles (and fifth bits) with a scale and a minimum per 32; a Stacked weight (fused
parts of different layouts) as its parts, one call over all. The kernel quantizes the activations to int8
per block of 32 columns and takes int8 dot products (AVX2, AVX-512BW, AVX512-VNNI, chosen at run time, and
a scalar path). Where no library can be built (no C++ compiler, MINISARATHI_QUANT_LINEAR=0), `matmul`
dequantizes the weight and uses NumPy's matmul on the exact activations: slower, the same memory.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minisarathi.backends.cpu.native import load_cpu_library
from minisarathi.quant.layouts import IntGroups, Stacked, UintGroups, pack_low

SOURCE = Path(__file__).resolve().parent / "quant_linear.cpp"
# No -mavx512f: each path has its target attribute and is chosen at run time. No -ffast-math: the order of
# each output's sums is what makes a row's result independent of its batch.
FLAGS = ["-std=c++17", "-O3", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wl,-z,defs"]
BLOCK = 32  # activation columns per int8 scale (the kernel's BLOCK)
KINDS = {"int8": 0, "int6": 1, "uint4": 2, "uint5": 3}  # the kernel's enum Kind
ISAS = {"scalar": 1, "avx2": 2, "avx512": 3, "avx512_vnni": 4}  # cpu_isa.h's enum Isa
ORDER = ["scalar", "avx2", "avx512", "avx512_vnni"]  # each path's CPU runs the ones before it

log = logging.getLogger(__name__)


class PartStruct(ctypes.Structure):
    """The kernel's struct Part."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("values", ctypes.c_void_p),
        ("high", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("minimum", ctypes.c_void_p),
    ]


@dataclass(frozen=True, eq=False)
class Part:
    """Rows [N, K] of one kind, as the kernel reads them (the arrays C-contiguous)."""

    kind: str  # one of KINDS
    group: int  # columns per scale: 16 or 32
    values: np.ndarray  # int8: int8[N, K]; else uint8[N, K // 2], UintGroups.low's order
    high: np.ndarray | None  # int6: uint8[N, K // 4] (top 2 bits); uint5: uint8[N, K // 8]; else None
    scale: np.ndarray  # float32[N, K // group]
    minimum: np.ndarray | None  # uint4, uint5: float32[N, K // 32]; else None
    source: str

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.values.shape
        return n, width if self.kind == "int8" else 2 * width

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.values, self.high, self.scale, self.minimum) if a is not None)

    def struct(self) -> PartStruct:
        def address(a):
            return None if a is None else a.ctypes.data

        arrays = (self.values, self.high, self.scale, self.minimum)
        return PartStruct(KINDS[self.kind], self.group, self.shape[0], *map(address, arrays))

    def layout(self, rows=slice(None)) -> IntGroups | UintGroups:
        """Rows `rows` as the layout they came from (dequantize() gives their float32 values)."""
        n, k = len(self.values[rows]), self.shape[1]
        if self.kind.startswith("uint"):
            high = None if self.high is None else self.high[rows]
            bits = 4 if high is None else 5
            return UintGroups(self.values[rows], high, self.scale[rows], self.minimum[rows], bits, (n, k), self.source)
        if self.kind == "int8":
            return IntGroups(self.values[rows], self.scale[rows], self.group, 8, (n, k), self.source)
        low = self.values[rows].reshape(n, k // BLOCK, 1, BLOCK // 2)
        codes = np.concatenate([low & 0x0F, low >> 4], axis=2).reshape(n, k // BLOCK, BLOCK)  # uint8
        top = self.high[rows].reshape(n, k // BLOCK, 1, 8) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        codes |= (top & 3).reshape(n, k // BLOCK, BLOCK) << 4
        values = (codes.astype(np.int8) - np.int8(32)).reshape(n, k)  # int8[n, K]
        return IntGroups(values, self.scale[rows], 16, 6, (n, k), self.source)


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A quantized weight w[N, K]: its parts stacked on their rows, as the kernel reads them."""

    parts: tuple[Part, ...]
    structs: ctypes.Array  # PartStruct[len(parts)], the parts' addresses read once

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def source(self) -> str:
        return "+".join(dict.fromkeys(p.source for p in self.parts))

    def dequantize(self) -> np.ndarray:
        """float32[N, K], the layouts' own dequantization."""
        return np.concatenate([p.layout().dequantize() for p in self.parts])

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32[T, K]: rows `ids` dequantized, nothing else (an embedding table's lookup)."""
        ids = np.asarray(ids)
        n = self.shape[0]
        if ids.size and not (0 <= ids.min() and ids.max() < n):
            raise IndexError(f"row ids must be in [0, {n}), got {ids.min()}..{ids.max()}")
        if len(self.parts) != 1:
            return self.dequantize()[ids]
        return self.parts[0].layout(ids).dequantize()


def runs(layout) -> bool:
    """Whether `layout` is a quantized matrix this module keeps compact."""
    if isinstance(layout, Stacked):
        return all(runs(p) for p in layout.parts)
    if isinstance(layout, UintGroups):
        return len(layout.shape) == 2
    return (
        isinstance(layout, IntGroups)
        and len(layout.shape) == 2
        and layout.shape[1] % BLOCK == 0
        and (layout.bits == 8 and (layout.group == 16 or layout.group % BLOCK == 0) or (layout.bits, layout.group) == (6, 16))
    )


def _part(layout: IntGroups | UintGroups) -> Part:
    f32 = functools.partial(np.ascontiguousarray, dtype=np.float32)
    if isinstance(layout, UintGroups):
        kind = "uint4" if layout.high is None else "uint5"
        high = None if layout.high is None else np.ascontiguousarray(layout.high)
        low = np.ascontiguousarray(layout.low)
        return Part(kind, BLOCK, low, high, f32(layout.scale), f32(layout.minimum), layout.source)
    n, k = layout.values.shape
    if layout.bits == 6:
        codes = (layout.values + np.int8(32)).view(np.uint8).reshape(n, k // BLOCK, 4, 8)  # in [0, 64)
        top = (codes >> 4) << np.array([0, 2, 4, 6], np.uint8)[:, None]  # byte j: codes j, j+8, j+16, j+24
        high = np.bitwise_or.reduce(top, axis=2).reshape(n, k // 4)  # uint8[N, K // 4]
        return Part("int6", 16, pack_low(codes.reshape(n, k)), high, f32(layout.scale), None, layout.source)
    # a group of 32 or more shares its scale over whole blocks: one scale per block of 32
    group = 16 if layout.group == 16 else BLOCK
    scale = np.repeat(f32(layout.scale), layout.group // group, axis=1)  # float32[N, K // group]
    return Part("int8", group, np.ascontiguousarray(layout.values), None, scale, None, layout.source)


def quant_weight(layout) -> QuantWeight:
    """`layout` (runs() true) in the kernel's form; the arrays that already are are shared, not copied."""
    if not runs(layout):
        raise ValueError(f"no compact CPU form for a {type(layout).__name__} of shape {list(layout.shape)}")
    parts = tuple(_part(p) for p in (layout.parts if isinstance(layout, Stacked) else (layout,)))
    return QuantWeight(parts, (PartStruct * len(parts))(*(p.struct() for p in parts)))


class QuantLinear:
    """The loaded library."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.lib.quant_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
        self.lib.quant_linear.restype = ctypes.c_int
        self.best_isa = ORDER[self.lib.quant_linear_best_isa() - 1]

    def matmul(self, x: np.ndarray, w: QuantWeight, isa: str | None = None) -> np.ndarray:
        """float32[M, N] = x[M, K] @ w.T, C order. isa: one of ORDER to force a path (ValueError where this
        CPU lacks it); None: the widest this CPU runs."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        m, k = x.shape
        n, width = w.shape
        if k != width:
            raise ValueError(f"x: {k} input features, the weight takes {width}")
        out = np.empty((m, n), dtype=np.float32)
        code = 0 if isa is None else ISAS[isa]
        ran = self.lib.quant_linear(x.ctypes.data, m, k, w.structs, len(w.parts), out.ctypes.data, code)
        if ran == -1:
            raise ValueError(f"quant_linear: this CPU cannot run the {isa} path")
        if ran < 0:
            raise RuntimeError(f"quant_linear failed ({'bad arguments' if ran == -2 else 'out of memory'})")
        return out


@functools.cache
def kernel() -> QuantLinear | None:
    """The library, built at first use; None where it cannot be (the log says why). CDLL: a matmul of many
    rows runs milliseconds, which the server's event loop may use meanwhile."""
    lib = load_cpu_library(
        SOURCE, FLAGS, "quantized matmul", "MINISARATHI_QUANT_LINEAR", hold_gil=False, log=log
    )
    return None if lib is None else QuantLinear(lib)


def matmul(x: np.ndarray, w: QuantWeight) -> np.ndarray:
    """float32[M, N] = x[M, K] @ w.T: the kernel, or NumPy on the dequantized weight where it is off."""
    native = kernel()
    if native is None:
        return np.asarray(x, dtype=np.float32) @ w.dequantize().T
    return native.matmul(x, w)
