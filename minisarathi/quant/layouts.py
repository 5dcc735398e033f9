"""The internal layouts of quantized weights, and the lossless conversion of each GGUF tensor type onto them.

A weight matrix has logical shape (..., C); its leading dimensions flatten to R rows, and every layout
groups each row's C weights into runs of `group` consecutive columns that share their
scale. Three layouts, and Stacked (quantized matrices of different layouts fused on their rows, each part
as it is):

IntGroups: signed integers, one scale per group; w = scale * value.
    values  int8[R, C]                       the integers, in [-2**(bits-1), 2**(bits-1))
    scale   float16 | float32 [R, C // group]
    Q8_0 -> bits 8, group 32, float16 scales (the block's d, as stored).
    Q6_K -> bits 6, group 16, float32 scales (d * the sub-block's int8 scale, exact).

UintGroups: unsigned 4- or 5-bit codes, one scale and one minimum per group of 32; w = scale * code - minimum.
    low      uint8[R, C // 2]    a group's 16 bytes: byte i holds code i's low 4 bits in its low nibble
                                 and code i+16's in its high nibble
    high     uint8[R, C // 8]    bits 5 only (else None): code c's fifth bit is bit c % 8 of byte c // 8
    scale    float32[R, C // 32]
    minimum  float32[R, C // 32]
    Q4_0 -> bits 4, scale d, minimum 8 * d (its implicit offset of -8).
    Q4_K -> bits 4, scale d * sc, minimum dmin * m (the 6-bit sub-block scale and minimum, exact).
    Q5_K -> bits 5, as Q4_K.

Dense: the weights as stored, float32 | float16 | uint16 (bfloat16 bits) [..., C] (F32, F16, BF16).

Fp8Rows: FP8 E4M3 weights (OCP E4M3FN bytes, as compressed-tensors and fp8 folders store them), one
float32 scale per row (a per-tensor scale repeated); w = scale * e4m3. input_scale is the static
activation scale as given, or None (dynamic). quant/hf_quantized.py makes it.

Exactness: every fp16 value has 11 significant bits and every K-quant sub-block scale at most 8, so each
product has at most 19 and is a float32 with no rounding. Each layout's dequantize() performs the same
float32 operations as the gguf package's dequantization, so the results are bit for bit the same; for Q4_0,
d * q - 8d equals ggml's d * (q - 8) as a number (both exact), and only a zero weight may differ in its sign.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import IntEnum

import numpy as np

from minisarathi.dtypes import dtype_name, to_float32

UINT_GROUP = 32  # UintGroups' weights per group
QK_K = 256  # weights per K-quant super-block


class GgmlType(IntEnum):
    """The GGUF tensor types converted here, by their numbers in the file (ggml's enum ggml_type)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# (weights, bytes) per block of each type
BLOCKS = {
    GgmlType.F32: (1, 4),
    GgmlType.F16: (1, 2),
    GgmlType.BF16: (1, 2),
    GgmlType.Q8_0: (32, 2 + 32),
    GgmlType.Q4_0: (32, 2 + 16),
    GgmlType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GgmlType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GgmlType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}


class UnsupportedTensorType(ValueError):
    """A GGUF tensor of a type that has no conversion here."""


@dataclass(frozen=True, eq=False)
class IntGroups:
    values: np.ndarray  # int8[R, C]
    scale: np.ndarray  # float16 | float32 [R, C // group]
    group: int
    bits: int
    shape: tuple[int, ...]  # the logical shape, R * C weights
    source: str  # the GGUF type it came from

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes

    def dequantize(self) -> np.ndarray:
        """float32[shape]."""
        R, C = self.values.shape
        values = self.values.reshape(R, C // self.group, self.group).astype(np.float32)
        return (self.scale.astype(np.float32)[..., None] * values).reshape(self.shape)


@dataclass(frozen=True, eq=False)
class UintGroups:
    low: np.ndarray  # uint8[R, C // 2]
    high: np.ndarray | None  # uint8[R, C // 8] where bits == 5
    scale: np.ndarray  # float32[R, C // 32]
    minimum: np.ndarray  # float32[R, C // 32]
    bits: int
    shape: tuple[int, ...]
    source: str

    group = UINT_GROUP

    @property
    def nbytes(self) -> int:
        high = 0 if self.high is None else self.high.nbytes
        return self.low.nbytes + high + self.scale.nbytes + self.minimum.nbytes

    def codes(self) -> np.ndarray:
        """uint8[R, C]: each weight's code, in [0, 2**bits)."""
        R, half = self.low.shape
        low = self.low.reshape(R, -1, 1, UINT_GROUP // 2)
        codes = np.concatenate([low & 0x0F, low >> 4], axis=2).reshape(R, 2 * half)  # uint8[R, C]
        if self.high is not None:
            codes |= np.unpackbits(self.high, axis=-1, count=2 * half, bitorder="little") << 4
        return codes

    def dequantize(self) -> np.ndarray:
        """float32[shape]."""
        codes = self.codes()
        R, C = codes.shape
        codes = codes.reshape(R, C // UINT_GROUP, UINT_GROUP).astype(np.float32)
        return (self.scale[..., None] * codes - self.minimum[..., None]).reshape(self.shape)


@dataclass(frozen=True, eq=False)
class Dense:
    data: np.ndarray  # float32 | float16 | uint16 (bfloat16 bits) [*shape], often a view of the file
    source: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def dequantize(self) -> np.ndarray:
        """float32[shape] (the data itself where it is float32)."""
        return to_float32(self.data, dtype_name(self.data))


@dataclass(frozen=True, eq=False)
class Stacked:
    """Quantized matrices [R_i, C] of different kinds stacked on their rows: a fused weight whose parts a file
    stores in different types (a Q4_K_M layer's Q4_K q/k and Q6_K v). Each part keeps its own layout."""

    parts: tuple  # of IntGroups | UintGroups, each [R_i, C]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def source(self) -> str:
        return "+".join(dict.fromkeys(p.source for p in self.parts))

    def dequantize(self) -> np.ndarray:
        """float32[shape]."""
        return np.concatenate([p.dequantize() for p in self.parts])


Layout = IntGroups | UintGroups | Dense | Stacked


def _same_form(a, b) -> bool:
    """Whether two layouts' arrays stack on their rows into one layout of the same kind."""
    if type(a) is not type(b) or a.shape[1:] != b.shape[1:] or a.bits != b.bits:
        return False
    return not isinstance(a, IntGroups) or (a.group, a.scale.dtype) == (b.group, b.scale.dtype)


def concatenate_rows(parts: list) -> np.ndarray | IntGroups | UintGroups | Stacked:
    """Matrices [R_i, C] stacked on their rows, losslessly: arrays as one array; quantized layouts of one
    form as one layout of that form (every group lies within its row, so the arrays stack alike); quantized
    layouts of different forms as a Stacked."""
    first = parts[0]
    if isinstance(first, np.ndarray):
        return np.concatenate(parts)
    if all(isinstance(p, Fp8Rows) for p in parts):
        return Fp8Rows.stack(parts)
    if not all(isinstance(p, IntGroups | UintGroups) for p in parts):
        raise ValueError("arrays and quantized layouts do not concatenate (dequantize the layouts first)")
    if not all(_same_form(first, p) for p in parts):
        return Stacked(tuple(parts))
    rows = sum(p.shape[0] for p in parts)
    shape = (rows, *first.shape[1:])
    if isinstance(first, IntGroups):
        values = np.concatenate([p.values for p in parts])
        scale = np.concatenate([p.scale for p in parts])
        return IntGroups(values, scale, first.group, first.bits, shape, first.source)
    high = None if first.high is None else np.concatenate([p.high for p in parts])
    return UintGroups(
        np.concatenate([p.low for p in parts]),
        high,
        np.concatenate([p.scale for p in parts]),
        np.concatenate([p.minimum for p in parts]),
        first.bits,
        shape,
        "+".join(dict.fromkeys(p.source for p in parts)),
    )


def take_rows(layout, rows: np.ndarray):
    """Rows `rows` (int[n]) of a quantized matrix [R, C], in that order: a row's codes, scales and
    minimums move with it, so the result is lossless (a reordering such as llama.cpp's Q/K one, or a
    tensor-parallel rank's share)."""
    shape = (len(rows), *layout.shape[1:])
    if isinstance(layout, Stacked):
        starts = np.cumsum([0] + [p.shape[0] for p in layout.parts])  # int[parts + 1]
        picks = []  # (part, its rows) for each run of consecutive rows within one part
        for row in rows:
            part = int(np.searchsorted(starts, row, side="right")) - 1
            if picks and picks[-1][0] == part:
                picks[-1][1].append(row - starts[part])
            else:
                picks.append((part, [row - starts[part]]))
        return concatenate_rows([take_rows(layout.parts[i], np.array(r)) for i, r in picks])
    if isinstance(layout, IntGroups | Fp8Rows):
        return replace(layout, values=layout.values[rows], scale=layout.scale[rows], shape=shape)
    high = None if layout.high is None else layout.high[rows]
    low, scale, minimum = layout.low[rows], layout.scale[rows], layout.minimum[rows]
    return replace(layout, low=low, high=high, scale=scale, minimum=minimum, shape=shape)


def take_columns(layout, start: int, stop: int):
    """Columns start..stop of a quantized matrix [R, C], losslessly: a row-parallel rank's share. Groups
    never split: ValueError where start or stop falls inside one."""
    if isinstance(layout, Stacked):
        return Stacked(tuple(take_columns(p, start, stop) for p in layout.parts))
    group = 1 if isinstance(layout, Fp8Rows) else layout.group
    if start % group or stop % group:
        raise ValueError(
            f"columns {start}..{stop} split a {layout.source} group of {group} weights: choose a "
            "tensor_parallel_size whose shares are whole groups"
        )
    shape = (layout.shape[0], stop - start)
    c = np.ascontiguousarray  # a rank keeps its own compact copy, in the form the kernels read
    if isinstance(layout, Fp8Rows):
        return replace(layout, values=c(layout.values[:, start:stop]), shape=shape)
    g0, g1 = start // group, stop // group
    if isinstance(layout, IntGroups):
        return replace(
            layout, values=c(layout.values[:, start:stop]), scale=c(layout.scale[:, g0:g1]), shape=shape
        )
    # a group's 32 codes lie in 16 low bytes (and 4 high bytes where bits == 5)
    high = None if layout.high is None else c(layout.high[:, g0 * group // 8 : g1 * group // 8])
    low = c(layout.low[:, g0 * group // 2 : g1 * group // 2])
    scale, minimum = c(layout.scale[:, g0:g1]), c(layout.minimum[:, g0:g1])
    return replace(layout, low=low, high=high, scale=scale, minimum=minimum, shape=shape)


def weight_format(weights: Mapping) -> str:
    """The matrices' storage, most weights first: "bfloat16", "Q8_0", "Q4_K+Q6_K" (a Q4_K_M file),
    "awq+float16" (an AWQ folder's linears and its 16-bit embedding table). Where a fused matrix mixes
    types (Stacked), each part counts under its own."""
    counts: dict[str, int] = {}
    for tensor in weights.values():
        if len(tensor.shape) != 2:
            continue  # norms and biases
        if getattr(tensor, "dtype", None) == "quantized":
            parts = [(p.source, p.shape) for p in getattr(tensor.data, "parts", (tensor.data,))]
        else:  # a loader CheckpointTensor's dtype name, or a NumPy array's
            parts = [(str(tensor.dtype), tensor.shape)]
        for kind, shape in parts:
            counts[kind] = counts.get(kind, 0) + int(np.prod(shape))
    return "+".join(sorted(counts, key=lambda k: -counts[k]))


def type_name(ggml_type: int) -> str:
    """A GGUF type's name, "Q4_K", also for types not converted here where the gguf package knows them."""
    if isinstance(ggml_type, IntEnum):
        return ggml_type.name
    try:
        return GgmlType(ggml_type).name
    except ValueError:
        pass
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"ggml type {int(ggml_type)}"


def tensor_type(name: str, ggml_type: int) -> GgmlType:
    """Tensor `name`'s GGUF type, or UnsupportedTensorType naming the tensor and the type."""
    try:
        return GgmlType(int(ggml_type))
    except ValueError:
        supported = ", ".join(t.name for t in GgmlType)
        raise UnsupportedTensorType(
            f"tensor {name!r} has GGUF type {type_name(ggml_type)}, which is not supported "
            f"(supported: {supported})"
        ) from None


def from_gguf(name: str, ggml_type: int, data: np.ndarray) -> Layout:
    """Tensor `name`'s layout from its data as gguf.GGUFReader gives it: for quantized types and BF16 the
    raw blocks, uint8[..., bytes per row]; for F16 and F32 the typed values (raw bytes are taken too)."""
    kind = tensor_type(name, ggml_type)
    weights, nbytes = BLOCKS[kind]
    raw = np.ascontiguousarray(data).view(np.uint8)  # uint8[..., row bytes]; a view, no copy
    lead, row_bytes = raw.shape[:-1], raw.shape[-1]
    if row_bytes % nbytes:
        raise ValueError(
            f"tensor {name!r} ({kind.name}): {row_bytes} bytes per row is not a whole number of "
            f"{nbytes}-byte blocks"
        )
    shape = (*lead, row_bytes // nbytes * weights)
    if kind in (GgmlType.F32, GgmlType.F16, GgmlType.BF16):
        storage = {GgmlType.F32: np.float32, GgmlType.F16: np.float16, GgmlType.BF16: np.uint16}[kind]
        return Dense(raw.view(storage), kind.name)
    rows, cols = math.prod(lead), shape[-1]
    blocks = raw.reshape(-1, nbytes)  # uint8[R * C // weights, nbytes]
    return CONVERTERS[kind](name, blocks, rows, cols, shape)


def from_reader_tensor(tensor) -> Layout:
    """The layout of one gguf.ReaderTensor."""
    return from_gguf(tensor.name, tensor.tensor_type, tensor.data)


def _f16(field: np.ndarray) -> np.ndarray:
    """float16[N] from the 2-byte columns uint8[N, 2] of N blocks."""
    return np.ascontiguousarray(field).view(np.float16)[:, 0]


def pack_low(codes: np.ndarray) -> np.ndarray:
    """UintGroups.low, uint8[R, C // 2], from codes uint8[R, C]: code i and i+16 of a group share a byte."""
    R, C = codes.shape
    pairs = codes.reshape(R, C // UINT_GROUP, 2, UINT_GROUP // 2) & 0x0F
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(R, C // 2)


def _q8_0(name, blocks, rows, cols, shape) -> IntGroups:
    scale = _f16(blocks[:, :2]).reshape(rows, cols // 32)  # float16[R, C // 32]
    values = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(rows, cols)  # int8[R, C]
    return IntGroups(values, scale, 32, 8, shape, "Q8_0")


def _q4_0(name, blocks, rows, cols, shape) -> UintGroups:
    d = _f16(blocks[:, :2]).astype(np.float32)  # float32[N]
    if not np.isfinite(d).all():
        # inf * q - inf * 8 is NaN where ggml's inf * (q - 8) is not: the mapping is exact only when finite
        raise ValueError(f"tensor {name!r} (Q4_0): a block's scale is not finite")
    # Q4_0 already pairs code i with code i+16 in a byte, as UintGroups.low does
    low = np.ascontiguousarray(blocks[:, 2:]).reshape(rows, cols // 2)  # uint8[R, C // 2]
    scale = d.reshape(rows, cols // 32)
    return UintGroups(low, None, scale, scale * np.float32(8), 4, shape, "Q4_0")


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and minimums uint8[N, 8] of Q4_K/Q5_K's 8 sub-blocks from their 12 bytes
    uint8[N, 12]: bytes 0-3 hold scales 0-3, bytes 4-7 minimums 0-3, each with 2 spare top bits that
    are the top bits of scale / minimum 4-7; bytes 8-11 hold the low 4 bits of those."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    minimums = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return scales, minimums


def _k_low_codes(qs: np.ndarray) -> np.ndarray:
    """uint8[N, 256] low 4 bits of Q4_K/Q5_K codes from qs uint8[N, 128]: 32 bytes per pair of
    sub-blocks, low nibbles the first sub-block's, high nibbles the second's."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, QK_K)


def _k_groups(name, kind, blocks, rows, cols, shape, high_bits, qs):
    d, dmin = _f16(blocks[:, 0:2]).astype(np.float32), _f16(blocks[:, 2:4]).astype(np.float32)  # float32[N]
    sc, m = _k_scales(blocks[:, 4:16])
    scale = (d[:, None] * sc.astype(np.float32)).reshape(rows, cols // 32)  # float32[R, C // 32]
    minimum = (dmin[:, None] * m.astype(np.float32)).reshape(rows, cols // 32)
    codes = _k_low_codes(qs).reshape(rows, cols)  # uint8[R, C]
    high = None
    if high_bits is not None:
        # Q5_K: bit j of qh[l] is the fifth bit of code l of sub-block j
        fifth = (high_bits[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # uint8[N, 8, 32]
        high = np.packbits(fifth.reshape(rows, cols), axis=-1, bitorder="little")  # uint8[R, C // 8]
    return UintGroups(pack_low(codes), high, scale, minimum, 4 if high is None else 5, shape, kind)


def _q4_k(name, blocks, rows, cols, shape) -> UintGroups:
    return _k_groups(name, "Q4_K", blocks, rows, cols, shape, None, blocks[:, 16:])


def _q5_k(name, blocks, rows, cols, shape) -> UintGroups:
    return _k_groups(name, "Q5_K", blocks, rows, cols, shape, blocks[:, 16:48], blocks[:, 48:])


def _q6_k(name, blocks, rows, cols, shape) -> IntGroups:
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)  # int8[N, 16]
    d = _f16(blocks[:, 208:210]).astype(np.float32)
    # Each half of 128 weights reads 64 bytes of ql and 32 of qh. Quarter k = 2 * nibble + run: the low
    # 4 bits are byte l (run 0) or l + 32 (run 1) of ql's nibble, the top 2 bits are qh[l] >> 2k.
    ql = ql.reshape(-1, 2, 1, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)  # uint8[N, half, k, l]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    top = (qh.reshape(-1, 2, 1, 32) >> shifts) & 0x03  # uint8[N, half, k, l]
    values = ((low | (top << 4)).astype(np.int8) - np.int8(32)).reshape(rows, cols)  # int8[R, C]
    scale = (d[:, None] * sc.astype(np.float32)).reshape(rows, cols // 16)  # float32[R, C // 16]
    return IntGroups(values, scale, 16, 6, shape, "Q6_K")


CONVERTERS = {
    GgmlType.Q8_0: _q8_0,
    GgmlType.Q4_0: _q4_0,
    GgmlType.Q4_K: _q4_k,
    GgmlType.Q5_K: _q5_k,
    GgmlType.Q6_K: _q6_k,
}


def _e4m3_values() -> np.ndarray:
    """float32[256]: each E4M3FN byte's value: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
    is subnormal, S.1111.111 is NaN, and there is no infinity."""
    byte = np.arange(256)
    sign = np.where(byte & 0x80, -1.0, 1.0)
    exponent, mantissa = (byte >> 3) & 0x0F, byte & 0x07
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.where((byte & 0x7F) == 0x7F, np.nan, sign * magnitude).astype(np.float32)


E4M3 = _e4m3_values()  # float32[256], every value exact (4 significant bits)


@dataclass(frozen=True, eq=False)
class Fp8Rows:
    values: np.ndarray  # uint8[R, C], E4M3FN bytes
    scale: np.ndarray  # float32[R]
    input_scale: float | None  # the static activation scale, or None where activations scale dynamically
    shape: tuple[int, ...]
    source: str

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes

    def dequantize(self) -> np.ndarray:
        """float32[shape]: one float32 product per weight."""
        return (E4M3[self.values] * self.scale[:, None]).reshape(self.shape)

    @staticmethod
    def stack(parts: list[Fp8Rows]) -> Fp8Rows:
        """Parts [R_i, C] on their rows, losslessly (scales are per row). The parts share one input, so a
        fused static input_scale is the largest of theirs, as vLLM takes it."""
        inputs = [p.input_scale for p in parts]
        input_scale = None if None in inputs else max(inputs)
        values = np.concatenate([p.values for p in parts])
        scale = np.concatenate([p.scale for p in parts])
        return Fp8Rows(values, scale, input_scale, values.shape, parts[0].source)
