"""The GGUF conversions of minisarathi/quant/layouts.py, bit for bit against the gguf package's own NumPy
dequantization (gguf.quants), on tensors of several rows and blocks; with negative controls (a flipped scale
or code bit changes the weights) and the errors for unsupported types and malformed rows."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from minisarathi.quant.layouts import (  # noqa: E402
    Dense,
    Fp8Rows,
    IntGroups,
    Stacked,
    UintGroups,
    UnsupportedTensorType,
    concatenate_rows,
    from_gguf,
    from_reader_tensor,
    take_columns,
    take_rows,
)

QUANTIZED = [T.Q8_0, T.Q4_0]  # gguf.quants quantizes these (and BF16)
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]  # no quantizer in gguf.quants: blocks built byte by byte
PASSTHROUGH = [T.F32, T.F16, T.BF16]
SUPPORTED = QUANTIZED + K_QUANTS + PASSTHROUGH
SHAPES = [(5, 768), (2, 3, 512)]  # several rows, several super-blocks per row, and a 3-D tensor
# the byte offsets of (the super-block scale d, a sub-block scale, a code) in one block of each type
FIELDS = {
    T.Q8_0: (0, None, 2),
    T.Q4_0: (0, None, 2),
    T.Q4_K: (0, 4, 16),
    T.Q5_K: (0, 4, 48),
    T.Q6_K: (208, 192, 0),
}


def f16_bytes(rng, n, low=1e-4, high=2e-2) -> np.ndarray:
    """uint8[n, 2]: finite positive fp16 values, the scales a quantizer writes for weights near 1."""
    return rng.uniform(low, high, n).astype(np.float16).view(np.uint8).reshape(n, 2)


def k_blocks(rng, qtype, shape) -> np.ndarray:
    """Random valid blocks of a K-quant type, uint8[..., bytes per row]: finite fp16 scales, random
    packed sub-block scales and codes (every byte of those is a valid value)."""
    weights, nbytes = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) // weights
    blocks = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    if qtype == T.Q6_K:
        blocks[:, 208:210] = f16_bytes(rng, n)
    else:
        blocks[:, 0:2], blocks[:, 2:4] = f16_bytes(rng, n), f16_bytes(rng, n)
    return blocks.reshape(*shape[:-1], shape[-1] // weights * nbytes)


def source(rng, qtype, shape) -> np.ndarray:
    """A tensor of the type as gguf.GGUFReader gives it, and as a GGUF writer would store it."""
    if qtype in K_QUANTS:
        return k_blocks(rng, qtype, shape)
    return quantize(rng.standard_normal(shape).astype(np.float32), qtype)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, qtype) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want, equal_nan=True)
    differ = got.view(np.uint32) != want.view(np.uint32)
    if qtype == T.Q4_0:  # d * q - 8d is +0 where ggml's d * (q - 8) is -0 for a negative d
        assert (want[differ] == 0).all()
    else:
        assert not differ.any()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_conversion_is_bit_exact(qtype, shape):
    raw = source(np.random.default_rng(int(qtype)), qtype, shape)
    layout = from_gguf("blk.0.ffn_up.weight", qtype, raw)
    assert layout.shape == shape and layout.source == qtype.name
    assert_bits_equal(layout.dequantize(), dequantize(raw, qtype), qtype)


@pytest.mark.parametrize("qtype", QUANTIZED + K_QUANTS + [T.BF16], ids=lambda t: t.name)
def test_any_bytes_convert_bit_exact(qtype):
    """Every byte pattern, NaN and infinite scales included, dequantizes as gguf's does (Q4_0 refuses a
    non-finite scale instead, where the offset as a minimum would give NaN)."""
    weights, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (6, 1024 // weights * nbytes), dtype=np.uint8)
    if qtype == T.Q4_0:
        raw.reshape(-1, nbytes)[:, 1] &= 0x7B  # an fp16 exponent below all ones: finite
    with np.errstate(invalid="ignore"):
        got, want = from_gguf("t", qtype, raw).dequantize(), dequantize(raw, qtype)
    assert_bits_equal(got, want, qtype)


def test_q4_0_rejects_a_non_finite_scale():
    raw = quantize(np.ones((2, 64), np.float32), T.Q4_0)
    raw[1, 18:20] = np.array([np.inf], np.float16).view(np.uint8)  # row 1, block 1's d
    with pytest.raises(ValueError, match=r"'blk.3.attn_q.weight' \(Q4_0\).*not finite"):
        from_gguf("blk.3.attn_q.weight", T.Q4_0, raw)


def test_layouts_shapes_and_dtypes():
    rng = np.random.default_rng(1)
    R, C = 4, 512
    q8 = from_gguf("t", T.Q8_0, source(rng, T.Q8_0, (R, C)))
    assert isinstance(q8, IntGroups) and (q8.group, q8.bits) == (32, 8)
    assert q8.values.dtype == np.int8 and q8.values.shape == (R, C)
    assert q8.scale.dtype == np.float16 and q8.scale.shape == (R, C // 32)
    q6 = from_gguf("t", T.Q6_K, source(rng, T.Q6_K, (R, C)))
    assert isinstance(q6, IntGroups) and (q6.group, q6.bits) == (16, 6)
    assert q6.scale.dtype == np.float32 and q6.scale.shape == (R, C // 16)
    assert q6.values.min() >= -32 and q6.values.max() <= 31 and q6.values.shape == (R, C)
    for qtype, bits in [(T.Q4_0, 4), (T.Q4_K, 4), (T.Q5_K, 5)]:
        u = from_gguf("t", qtype, source(rng, qtype, (R, C)))
        assert isinstance(u, UintGroups) and u.bits == bits and u.group == 32
        assert u.low.dtype == np.uint8 and u.low.shape == (R, C // 2)
        assert (u.high is None) if bits == 4 else (u.high.dtype == np.uint8 and u.high.shape == (R, C // 8))
        for field in (u.scale, u.minimum):
            assert field.dtype == np.float32 and field.shape == (R, C // 32)
        codes = u.codes()
        assert codes.shape == (R, C) and codes.max() < 2**bits
        assert u.nbytes == R * C * bits // 8 + 2 * 4 * R * C // 32
    for qtype, dtype in [(T.F32, np.float32), (T.F16, np.float16), (T.BF16, np.uint16)]:
        d = from_gguf("t", qtype, source(rng, qtype, (R, C)))
        assert isinstance(d, Dense) and d.data.dtype == dtype and d.shape == (R, C)


def test_q4_k_and_q5_k_keep_the_codes_and_scales():
    """The layout's codes, scales and minimums are the block's own, read straight from a block built with
    known sub-block 0 (scale 5, minimum 3) and sub-block 7 (scale 63, minimum 40)."""
    for qtype, qs_at in [(T.Q4_K, 16), (T.Q5_K, 48)]:
        block = np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8)
        block[0, 0:4] = np.array([0.5, 0.25], np.float16).view(np.uint8)  # d, dmin
        block[0, 4], block[0, 8] = 5, 3  # scale 0, minimum 0
        # scale 7's top 2 bits in the spare bits of scale 3's byte, minimum 7's in minimum 3's byte, and
        # both their low 4 bits in the last of the 12 bytes
        block[0, 4 + 3], block[0, 4 + 7] = (63 >> 4) << 6, (40 >> 4) << 6
        block[0, 4 + 11] = (63 & 0x0F) | ((40 & 0x0F) << 4)
        block[0, qs_at] = 0x9 | (0x4 << 4)  # code 0 of sub-blocks 0 and 1
        u = from_gguf("t", qtype, block)
        assert u.scale[0, 0] == 0.5 * 5 and u.minimum[0, 0] == 0.25 * 3
        assert u.scale[0, 7] == 0.5 * 63 and u.minimum[0, 7] == 0.25 * 40
        assert u.codes()[0, 0] == 9 and u.codes()[0, 32] == 4
        assert_bits_equal(u.dequantize(), dequantize(block, qtype), qtype)


def test_sub_block_scale_products_are_exact_in_float32():
    """Every finite fp16 d times every 6-bit K-quant scale (Q4_K, Q5_K) and every int8 one (Q6_K) is a
    float32 with no rounding; and Q4_0's minimum form, d * q - 8d, is d * (q - 8) exactly."""
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    d = bits[np.isfinite(bits)].astype(np.float32)
    for s in range(-128, 128):
        assert np.array_equal((d * np.float32(s)).astype(np.float64), d.astype(np.float64) * s)
    for q in range(16):
        assert np.array_equal(d * np.float32(q) - d * np.float32(8), d * np.float32(q - 8))


@pytest.mark.parametrize("qtype", list(FIELDS), ids=lambda t: t.name)
def test_negative_controls(qtype):
    """A flipped bit in the super-block scale, a sub-block scale or a code changes the converted weights
    (and still matches gguf's reading of the flipped bytes): the comparison sees the data it compares."""
    shape = (3, 512)
    raw = source(np.random.default_rng(3), qtype, shape)
    base = from_gguf("t", qtype, raw).dequantize()
    nbytes = GGML_QUANT_SIZES[qtype][1]
    d_at, sub_at, code_at = FIELDS[qtype]
    for at, at_most in [(d_at, None), (sub_at, None), (code_at, 1)]:
        if at is None:
            continue
        flipped = raw.copy()
        flipped.reshape(-1, nbytes)[1, at] ^= 0x01  # block 1 of the tensor
        got = from_gguf("t", qtype, flipped).dequantize()
        changed = int((got != base).sum())
        assert changed >= 1 and (at_most is None or changed <= at_most)
        assert not np.array_equal(got, base)
        assert_bits_equal(got, dequantize(flipped, qtype), qtype)
    if qtype == T.Q5_K:  # bit 0 of qh[0]: the fifth bit of code 0 of sub-block 0, worth 16 * its scale
        flipped = raw.copy()
        flipped.reshape(-1, nbytes)[0, 16] ^= 0x01
        got = from_gguf("t", qtype, flipped).dequantize()
        scale = from_gguf("t", qtype, raw).scale[0, 0]
        assert (got != base).sum() == 1 and abs(got[0, 0] - base[0, 0]) == 16 * scale


def test_unsupported_type_names_the_tensor_and_its_type():
    raw = np.zeros((2, 20 * 4), np.uint8)  # Q4_1: 20-byte blocks of 32
    with pytest.raises(UnsupportedTensorType, match=r"'blk.0.attn_k.weight' has GGUF type Q4_1.*Q4_K"):
        from_gguf("blk.0.attn_k.weight", T.Q4_1, raw)
    with pytest.raises(UnsupportedTensorType, match=r"'x' has GGUF type IQ2_XS"):
        from_gguf("x", int(T.IQ2_XS), raw)
    with pytest.raises(UnsupportedTensorType, match=r"'x' has GGUF type ggml type 99"):
        from_gguf("x", 99, raw)


def test_a_row_of_partial_blocks_is_an_error():
    with pytest.raises(ValueError, match=r"'output.weight' \(Q6_K\): 300 bytes per row"):
        from_gguf("output.weight", T.Q6_K, np.zeros((2, 300), np.uint8))


def test_through_a_gguf_file(tmp_path):
    """Tensors written with gguf.GGUFWriter and read back with gguf.GGUFReader convert as the arrays do."""
    rng = np.random.default_rng(5)
    sources = {f"t.{t.name}": (t, source(rng, t, (3, 512))) for t in SUPPORTED}
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    for name, (qtype, raw) in sources.items():
        writer.add_tensor(name, raw, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = gguf.GGUFReader(tmp_path / "m.gguf").tensors
    assert sorted(t.name for t in tensors) == sorted(sources)
    for tensor in tensors:
        qtype, raw = sources[tensor.name]
        layout = from_reader_tensor(tensor)
        assert layout.shape == (3, 512)
        assert_bits_equal(layout.dequantize(), dequantize(raw, qtype), qtype)


@pytest.mark.parametrize(
    "types, kind",
    [
        ((T.Q4_K, T.Q4_K), UintGroups),
        ((T.Q5_K, T.Q5_K, T.Q5_K), UintGroups),
        ((T.Q8_0, T.Q8_0), IntGroups),
        ((T.Q4_K, T.Q6_K), Stacked),  # a Q4_K_M layer's q/k and v
        ((T.Q4_K, T.Q5_K), Stacked),  # one kind, different bits
        ((T.Q8_0, T.Q6_K), Stacked),  # one kind, different groups
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "+".join(t.name for t in v),
)
def test_fused_parts_concatenate_losslessly(types, kind):
    rng = np.random.default_rng(7)
    parts = [from_gguf(f"part{i}", t, source(rng, t, (3 + i, 512))) for i, t in enumerate(types)]
    fused = concatenate_rows(parts)
    assert type(fused) is kind and fused.shape == (sum(p.shape[0] for p in parts), 512)
    assert fused.nbytes == sum(p.nbytes for p in parts)
    assert np.array_equal(fused.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    with pytest.raises(ValueError, match="do not concatenate"):
        concatenate_rows([*parts, np.zeros((1, 512), np.float32)])


@pytest.mark.parametrize("types", [(T.Q4_K,), (T.Q5_K,), (T.Q6_K,), (T.Q8_0,), (T.Q4_K, T.Q6_K)], ids=str)
def test_rows_and_whole_group_columns_slice_losslessly(types):
    rng = np.random.default_rng(3)
    parts = [from_gguf(f"part{i}", t, source(rng, t, (4 + i, 512))) for i, t in enumerate(types)]
    layout = concatenate_rows(parts)
    full = layout.dequantize()
    rows = np.array([len(full) - 1, 0, 2, 3, 1])  # across the parts of a Stacked, out of order
    assert np.array_equal(take_rows(layout, rows).dequantize(), full[rows])
    for start, stop in [(0, 256), (256, 512), (64, 96)]:
        share = take_columns(layout, start, stop)
        assert share.shape == (len(full), stop - start)
        assert np.array_equal(share.dequantize(), full[:, start:stop])
    with pytest.raises(ValueError, match="split a .* group of (16|32) weights"):
        take_columns(layout, 8, 256)


def test_fp8_rows_slice_on_any_column():
    rng = np.random.default_rng(4)
    layout = Fp8Rows(
        rng.integers(0, 0x7E, (6, 40), dtype=np.uint8), rng.random(6, np.float32), None, (6, 40), "fp8"
    )
    full = layout.dequantize()
    assert np.array_equal(take_columns(layout, 3, 17).dequantize(), full[:, 3:17])
    assert np.array_equal(take_rows(layout, np.array([5, 1])).dequantize(), full[[5, 1]])
