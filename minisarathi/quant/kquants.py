"""NumPy quantizers that write GGUF blocks: Q8_0 and Q4_0 through gguf.quants, and Q4_K, Q5_K and Q6_K,
which gguf.quants cannot write, by a plain min/max rule (llama.cpp's own K-quantizers also search for
better scales, so their error is lower). For test models and quality measurements, not for serving.

Each K-quant super-block of 256 weights gets fp16 `d` (and `dmin`) and per sub-block an integer scale
(and minimum) of 6 bits (Q4_K/Q5_K, sub-blocks of 32) or 8 bits signed (Q6_K, sub-blocks of 16); the block
bytes are laid out as minisarathi/quant/layouts.py (and ggml) reads them.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")


def quantize(weights: np.ndarray, qtype: str) -> np.ndarray:
    """uint8[..., bytes per row]: `weights` float32[..., C] as blocks of `qtype` (one of TYPES)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    weights = np.asarray(weights, dtype=np.float32)
    if qtype in ("Q8_0", "Q4_0"):
        return gguf_quantize(weights, GGMLQuantizationType[qtype])
    if qtype not in TYPES:
        raise ValueError(f"quantize: type {qtype!r} is not one of {', '.join(TYPES)}")
    if weights.shape[-1] % QK_K:
        raise ValueError(f"quantize: {qtype} needs rows of a multiple of {QK_K} weights, got {weights.shape}")
    blocks = weights.reshape(-1, QK_K)  # float32[N, 256]: one super-block a row
    packed = _q6_k(blocks) if qtype == "Q6_K" else _uint_k(blocks, 4 if qtype == "Q4_K" else 5)
    return packed.reshape(*weights.shape[:-1], -1)


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    """uint8[N, 2]: float16 values float16[N] as stored."""
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _integer_scales(values: np.ndarray, d: np.ndarray, top: int) -> np.ndarray:
    """int32[N, S]: round(values / d) within [0, top] (0 where d is 0), values float32[N, S], d float16[N]."""
    d = d.astype(np.float32)[:, None]
    return np.clip(np.rint(values / np.where(d > 0, d, 1)), 0, top).astype(np.int32)


def _codes(shifted: np.ndarray, step: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """int32: round(shifted / step) within [lo, hi], 0 where step is 0 (a sub-block of zeros)."""
    safe = np.where(step > 0, step, 1)[..., None]
    codes = np.clip(np.rint(shifted / safe), lo, hi).astype(np.int32)
    return np.where(step[..., None] > 0, codes, 0)


def _uint_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5) blocks uint8[N, 144 | 176]: w = d * sc * q - dmin * m per
    sub-block of 32, with its range [min(w, 0), max(w)] spread over the codes."""
    top = 2**bits - 1
    sub = blocks.reshape(-1, 8, 32)  # float32[N, 8, 32]
    lo = np.minimum(sub.min(axis=-1), 0)  # float32[N, 8]
    scale, minimum = (sub.max(axis=-1) - lo) / top, -lo
    d, dmin = (scale.max(axis=-1) / 63).astype(np.float16), (minimum.max(axis=-1) / 63).astype(np.float16)
    sc, m = _integer_scales(scale, d, 63), _integer_scales(minimum, dmin, 63)  # int32[N, 8] in [0, 63]
    step = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    offset = dmin.astype(np.float32)[:, None] * m.astype(np.float32)
    q = _codes(sub + offset[..., None], step, 0, top)  # int32[N, 8, 32]
    # 12 bytes of scales: bytes 0-3 and 4-7 hold sc and m of sub-blocks 0-3 with the top 2 bits of those of
    # sub-blocks 4-7 above them; bytes 8-11 the low 4 bits of sub-blocks 4-7's sc (low nibble) and m
    a = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    b = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    scales = np.concatenate([a, b, c], axis=1).astype(np.uint8)  # uint8[N, 12]
    pairs = (q & 0x0F).reshape(-1, 4, 2, 32)  # sub-blocks 2j and 2j + 1 share 32 bytes: low, high nibble
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).astype(np.uint8).reshape(-1, 128)
    fields = [_fp16_bytes(d), _fp16_bytes(dmin), scales]
    if bits == 5:  # bit j of qh[l]: the fifth bit of code l of sub-block j
        fifth = (q >> 4) & 1  # int32[N, 8, 32]
        fields.append((fifth << np.arange(8)[None, :, None]).sum(axis=1).astype(np.uint8))  # uint8[N, 32]
    return np.concatenate([*fields, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks uint8[N, 210]: w = d * sc * (q - 32) per sub-block of 16, sc in [0, 127], the largest
    magnitude at q - 32 = +-31."""
    sub = blocks.reshape(-1, 16, 16)  # float32[N, 16, 16]
    scale = np.abs(sub).max(axis=-1) / 31  # float32[N, 16]
    d = (scale.max(axis=-1) / 127).astype(np.float16)
    sc = _integer_scales(scale, d, 127)  # int32[N, 16]
    step = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    q = (_codes(sub, step, -32, 31) + 32).reshape(-1, 2, 4, 32)  # int32[N, half, quarter k, l]
    # a half's 64 ql bytes: byte run * 32 + l holds quarter run's low 4 bits (low nibble) and quarter
    # run + 2's (high nibble); its 32 qh bytes: bits 2k, 2k + 1 of byte l are quarter k's top 2 bits
    ql = (q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)  # [N, 2, 2, 32]
    qh = (((q >> 4) & 0x03) << (2 * np.arange(4))[None, None, :, None]).sum(axis=2)  # [N, 2, 32]
    return np.concatenate(
        [
            ql.astype(np.uint8).reshape(-1, 128),
            qh.astype(np.uint8).reshape(-1, 64),
            sc.astype(np.int8).view(np.uint8),
            _fp16_bytes(d),
        ],
        axis=1,
    )
