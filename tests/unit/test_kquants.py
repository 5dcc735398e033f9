"""The NumPy quantizers of minisarathi/quant/kquants.py: their blocks, read back by the gguf package's own
dequantization, are within each type's error bound of the weights, and the bound is tight enough that a
wrong packing fails it."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from minisarathi.quant.kquants import quantize  # noqa: E402
from minisarathi.quant.layouts import from_gguf  # noqa: E402

K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]


def weights(rng) -> np.ndarray:
    """float32[6, 512]: normal rows, a row of one sign, a constant row and a row of zeros."""
    w = rng.standard_normal((6, 512)).astype(np.float32)
    w[3] = np.abs(w[3]) + 0.5
    w[4], w[5] = -0.25, 0.0
    return w


def bound(w: np.ndarray, qtype: str) -> np.ndarray:
    """float64[N, 256]: each weight's error bound. Q4_K/Q5_K (top = 2**bits - 1): half a step of the
    sub-block's scale, plus what rounding the 6-bit sub-block scale and minimum to d / 2 and dmin / 2
    loses at the range's ends: top * d / 2 + dmin / 2, with d = max scale / 63 and dmin = max minimum / 63.
    Q6_K: half a step, plus 31 * d / 2 at the largest magnitude, d = max scale / 127."""
    blocks = w.astype(np.float64).reshape(-1, 256)
    if qtype == "Q6_K":
        sub = blocks.reshape(-1, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = scale.max(-1, keepdims=True) / 127
        per_sub = scale / 2 + 31 * d / 2 + d / 2
    else:
        top = 15 if qtype == "Q4_K" else 31
        sub = blocks.reshape(-1, 8, 32)
        lo = np.minimum(sub.min(-1), 0)
        scale, minimum = (sub.max(-1) - lo) / top, -lo
        d, dmin = scale.max(-1, keepdims=True) / 63, minimum.max(-1, keepdims=True) / 63
        per_sub = scale / 2 + (top + 1) * d / 2 + dmin / 2
    per_sub = per_sub * (1 + 2e-3) + 1e-7  # the fp16 rounding of d and dmin
    return np.repeat(per_sub, sub.shape[-1], axis=-1).reshape(w.shape)


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_round_trip_error_is_within_the_bound(qtype):
    w = weights(np.random.default_rng(7))
    blocks = quantize(w, qtype)
    assert blocks.shape == (6, 512 // 256 * gguf.GGML_QUANT_SIZES[T[qtype]][1])
    back = dequantize(blocks, T[qtype])
    limit = bound(w, qtype)
    assert (np.abs(back - w) <= limit).all()
    assert np.array_equal(from_gguf("w", T[qtype], blocks).dequantize(), back)
    assert (back[5] == 0).all()
    # the bound is a few steps wide, not loose: the typical error is well inside it
    assert np.abs(back - w).mean() < limit.mean() / 2


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_a_wrong_packing_breaks_the_bound(qtype):
    w = weights(np.random.default_rng(7))
    blocks = quantize(w, qtype).reshape(-1, gguf.GGML_QUANT_SIZES[T[qtype]][1])
    codes = slice(0, 128) if qtype == "Q6_K" else slice(-128, None)
    swapped = blocks.copy()
    swapped[:, codes] = (swapped[:, codes] >> 4) | (swapped[:, codes] << 4)  # nibbles in the wrong order
    back = dequantize(swapped.reshape(6, -1), T[qtype])
    assert (np.abs(back - w) > bound(w, qtype)).any()


def test_fewer_bits_give_larger_errors_and_q8_0_q4_0_come_from_gguf():
    w = np.random.default_rng(8).standard_normal((8, 1024)).astype(np.float32)
    rms = {t: np.sqrt(((dequantize(quantize(w, t), T[t]) - w) ** 2).mean()) for t in ("Q8_0", *K_QUANTS)}
    assert rms["Q8_0"] < rms["Q6_K"] < rms["Q5_K"] < rms["Q4_K"]
    assert np.array_equal(quantize(w, "Q4_0"), gguf.quants.quantize(w, T.Q4_0))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="Q4_K needs rows of a multiple of 256"):
        quantize(np.zeros((2, 128), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="type 'Q2_K' is not one of"):
        quantize(np.zeros((2, 256), np.float32), "Q2_K")
