"""The CPU's matmul for quantized weights kept compact: quant_linear.cpp, compiled at first use (ctypes).

Every quantized matrix layout (minisarathi/quant/layouts.py) is kept in a form close to its file's bytes and
multiplied there: IntGroups of 8 bits (Q8_0, GPTQ-8) as int8 values and a scale per 16 or 32
columns (fp16 where the layout's are: Q8_0's, else float32); IntGroups of 6 bits (Q6_K) as 4 + 2 bits a
weight and a scale per 16; UintGroups (Q4_0, Q4_K, Q5_K, AWQ, GPTQ-4) as their nibbles (and fifth bits)
with a scale and a minimum per 32; a Stacked weight (fused parts of different layouts) as its parts, one
call over all. The kernel quantizes the activations to int8
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
from minisarathi.backends.cpu.process_setup import kernel_threads
from minisarathi.quant.layouts import IntGroups, Stacked, UintGroups, pack_low

SOURCE = Path(__file__).resolve().parent / "quant_linear.cpp"
# No -mavx512f: each path has its target attribute and is chosen at run time. No -ffast-math: the order of
# each output's sums is what makes a row's result independent of its batch.
FLAGS = ["-std=c++17", "-O3", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wl,-z,defs", "-fopenmp"]
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
        ("scale_sub", ctypes.c_void_p),
        ("minimum", ctypes.c_void_p),
        ("minimum_sub", ctypes.c_void_p),
        ("half_scale", ctypes.c_int64),
    ]


SUPER = 256  # columns per float32 factor of factored scales (a K-quant super-block)
# The int8 factor tried first for a super-block's largest scale: the K-quant quantizers give it 63 (Q4_K's
# and Q5_K's 6-bit scales) or -128 / 127 (Q6_K's int8 ones); the others only for super-blocks left over.
FIRST_TOPS = (63, -128, 127, -127)
TOPS = FIRST_TOPS + tuple(t for m in range(126, 0, -1) for t in (m, -m) if t not in FIRST_TOPS)


@dataclass(frozen=True, eq=False)
class Part:
    """Rows [N, K] of one kind, as the kernel reads them (the arrays C-contiguous)."""

    kind: str  # one of KINDS
    group: int  # columns per scale: 16 or 32
    values: np.ndarray  # int8: int8[N, K]; else uint8[N, K // 2], UintGroups.low's order
    high: np.ndarray | None  # int6: uint8[N, K // 4] (top 2 bits); uint5: uint8[N, K // 8]; else None
    scale: (
        np.ndarray
    )  # float32[N, K // group], or float32[N, K // 256] where scale_sub is given; int8: float16
    # [N, K // group] where the layout's scales are (Q8_0's, exactly as the file keeps them)
    scale_sub: np.ndarray | None  # int8[N, K // group]: a group's scale = its 256 columns' factor * this
    minimum: np.ndarray | None  # uint4, uint5: float32[N, K // 32], or [N, K // 256] as scale; else None
    minimum_sub: np.ndarray | None  # int8[N, K // 32] or None
    source: str

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.values.shape
        return n, width if self.kind == "int8" else 2 * width

    def arrays(self) -> tuple:
        return self.values, self.high, self.scale, self.scale_sub, self.minimum, self.minimum_sub

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays() if a is not None)

    def struct(self) -> PartStruct:
        addresses = (None if a is None else a.ctypes.data for a in self.arrays())
        half = self.scale.dtype == np.float16
        return PartStruct(KINDS[self.kind], self.group, self.shape[0], *addresses, half)

    def layout(self, rows=slice(None)) -> IntGroups | UintGroups:
        """Rows `rows` as the layout they came from (dequantize() gives their float32 values)."""
        n, k = len(self.values[rows]), self.shape[1]
        scale = _product(self.scale[rows], self.scale_sub, rows)
        if self.kind.startswith("uint"):
            high = None if self.high is None else self.high[rows]
            minimum = _product(self.minimum[rows], self.minimum_sub, rows)
            bits = 4 if high is None else 5
            return UintGroups(self.values[rows], high, scale, minimum, bits, (n, k), self.source)
        if self.kind == "int8":
            return IntGroups(self.values[rows], scale, self.group, 8, (n, k), self.source)
        low = self.values[rows].reshape(n, k // BLOCK, 1, BLOCK // 2)
        codes = np.concatenate([low & 0x0F, low >> 4], axis=2).reshape(n, k // BLOCK, BLOCK)  # uint8
        top = self.high[rows].reshape(n, k // BLOCK, 1, 8) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        codes |= (top & 3).reshape(n, k // BLOCK, BLOCK) << 4
        values = (codes.astype(np.int8) - np.int8(32)).reshape(n, k)  # int8[n, K]
        return IntGroups(values, scale, 16, 6, (n, k), self.source)


def _product(values: np.ndarray, sub: np.ndarray | None, rows) -> np.ndarray:
    """float32[n, groups]: per-group values from factored ones (exact products) where sub is given."""
    if sub is None:
        return values
    sub = sub[rows]
    return np.repeat(values, sub.shape[1] // values.shape[1], axis=1) * sub.astype(np.float32)


def factored(values: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, None]:
    """(float32[N, K // 256], int8[N, K // group]) whose products are exactly `values` (float32[N, K //
    group], the scales or minimums of groups of `group` columns), as K-quants store them; or (values, None)
    where some super-block has no such factoring (scales not from a K-quant: Q4_0, AWQ, GPTQ)."""
    n, groups = values.shape
    per = SUPER // group
    if groups % per:
        return values, None
    blocks = values.reshape(-1, per)  # float32[S, per], one super-block a row
    top = np.abs(blocks).max(axis=1)
    factor = np.zeros(len(blocks), np.float32)
    sub = np.zeros(blocks.shape, np.int8)
    left = np.flatnonzero(top != 0)  # an all-zero super-block is 0 * 0
    with np.errstate(all="ignore"):
        for i, first in enumerate(TOPS):
            if not left.size:
                break
            if i == len(FIRST_TOPS) and left.size > len(blocks) // 100:
                return values, None  # not a K-quant's scales: not worth trying every factor
            d = top[left] / np.float32(first)  # float32[L]
            q = np.rint(blocks[left] / d[:, None])
            ok = ((q >= -128) & (q <= 127)).all(axis=1)
            ok &= ((d[:, None] * q.astype(np.float32)) == blocks[left]).all(axis=1)
            factor[left[ok]], sub[left[ok]] = d[ok], q[ok]
            left = left[~ok]
    if left.size:
        return values, None
    return factor.reshape(n, groups // per), sub.reshape(n, groups)


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
        and (
            layout.bits == 8
            and (layout.group == 16 or layout.group % BLOCK == 0)
            or (layout.bits, layout.group) == (6, 16)
        )
    )


def _part(layout: IntGroups | UintGroups) -> Part:
    f32 = functools.partial(np.ascontiguousarray, dtype=np.float32)
    if isinstance(layout, UintGroups):
        kind = "uint4" if layout.high is None else "uint5"
        high = None if layout.high is None else np.ascontiguousarray(layout.high)
        scale, scale_sub = factored(f32(layout.scale), BLOCK)
        minimum, minimum_sub = factored(f32(layout.minimum), BLOCK)
        if (scale_sub is None) != (minimum_sub is None):  # both factored or neither: one form a part
            scale, scale_sub, minimum, minimum_sub = f32(layout.scale), None, f32(layout.minimum), None
        low = np.ascontiguousarray(layout.low)
        return Part(kind, BLOCK, low, high, scale, scale_sub, minimum, minimum_sub, layout.source)
    n, k = layout.values.shape
    if layout.bits == 6:
        codes = (layout.values + np.int8(32)).view(np.uint8).reshape(n, k // BLOCK, 4, 8)  # in [0, 64)
        top = (codes >> 4) << np.array([0, 2, 4, 6], np.uint8)[:, None]  # byte j: codes j, j+8, j+16, j+24
        high = np.bitwise_or.reduce(top, axis=2).reshape(n, k // 4)  # uint8[N, K // 4]
        scale, scale_sub = factored(f32(layout.scale), 16)
        low = pack_low(codes.reshape(n, k))
        return Part("int6", 16, low, high, scale, scale_sub, None, None, layout.source)
    # a group of 32 or more shares its scale over whole blocks: one scale per block of 32; fp16 scales stay
    # fp16 (2 bytes fewer a block to read, widened exactly by the kernel)
    group = 16 if layout.group == 16 else BLOCK
    scale = layout.scale if layout.scale.dtype == np.float16 else f32(layout.scale)
    scale = np.ascontiguousarray(np.repeat(scale, layout.group // group, axis=1))  # [N, K // group]
    values = np.ascontiguousarray(layout.values)
    return Part("int8", group, values, None, scale, None, None, None, layout.source)


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
        self.lib.quant_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
        self.lib.quant_linear.restype = ctypes.c_int
        self.best_isa = ORDER[self.lib.quant_linear_best_isa() - 1]

    def matmul(
        self, x: np.ndarray, w: QuantWeight, isa: str | None = None, threads: int | None = None
    ) -> np.ndarray:
        """float32[M, N] = x[M, K] @ w.T, C order. isa: one of ORDER to force a path (ValueError where this
        CPU lacks it); None: the widest this CPU runs. threads: None, kernel_threads()."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        m, k = x.shape
        n, width = w.shape
        if k != width:
            raise ValueError(f"x: {k} input features, the weight takes {width}")
        out = np.empty((m, n), dtype=np.float32)
        code = 0 if isa is None else ISAS[isa]
        ran = self.lib.quant_linear(
            x.ctypes.data,
            m,
            k,
            w.structs,
            len(w.parts),
            out.ctypes.data,
            code,
            kernel_threads() if threads is None else threads,
        )
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
