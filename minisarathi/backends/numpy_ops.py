"""The reference backend: the ops of docs/architecture.md in float32 NumPy on the CPU.

Rows of `x` are tokens. Weights keep HF's [out, in] layout, so a linear layer is `x @ w.T`, which BLAS
reads as a transposed operand without a copy.
"""
from __future__ import annotations

import numpy as np

from minisarathi.engine.batch import Batch

activation_dtype = np.dtype(np.float32)  # of activations and the KV cache


def weight(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32)


def zeros(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, dtype=np.float32)


def to_numpy(x: np.ndarray) -> np.ndarray:
    return x


def embedding(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return np.take(table, ids, axis=0)  # float32[T, H]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    mean_square = np.einsum("th,th->t", x, x) / x.shape[1]  # float32[T], no x*x temporary
    scale = 1.0 / np.sqrt(mean_square + np.float32(eps))
    out = x * scale[:, None]
    out *= w
    return out


def add_rms_norm(x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    residual += x
    return rms_norm(residual, w, eps), residual


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    out = x @ w.T  # float32[T, N]
    if bias is not None:
        out += bias
    return out


def rope(q: np.ndarray, k: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> None:
    """Rotates q[T, Hq, D] and k[T, Hk, D] in place; pairs are (i, i + D/2) as in HF's rotate_half."""
    angles = positions.astype(np.float32)[:, None] * inv_freq  # float32[T, D/2], as HF computes them
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    half = inv_freq.shape[0]
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half:]
        rotated_x1 = x1 * cos - x2 * sin
        x2 *= cos
        x2 += x1 * sin
        x1[...] = rotated_x1


def store_kv(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
             slot_mapping: np.ndarray) -> None:
    block_size = k_cache.shape[2]
    blocks, offsets = np.divmod(slot_mapping, block_size)
    # Caches are [num_blocks, Hk, block_size, D]; indexing axes 0 and 2 selects [T, Hk, D].
    k_cache[blocks, :, offsets] = k
    v_cache[blocks, :, offsets] = v


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, batch: Batch,
                    scale: float) -> np.ndarray:
    """float32[T, Hq, D]: each query attends causally to its own sequence's keys in the paged cache.

    Single-token runs (decodes) are done together, padded to the longest context; longer runs (prefill
    chunks) one sequence at a time. GQA never copies K/V per query head: queries are grouped as
    [Hk, G, ...] and multiplied against the shared [Hk, n, D] keys.
    """
    T, Hq, D = q.shape
    Hk, block_size = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hk
    q = (q * np.float32(scale)).reshape(T, Hk, G, D)
    out = np.empty((T, Hk, G, D), dtype=np.float32)
    q_lens = np.diff(batch.query_start)
    decodes = np.flatnonzero(q_lens == 1)
    if len(decodes):
        rows = batch.query_start[decodes]
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, batch.block_tables[decodes],
                                      batch.context_lens[decodes])
    for s in np.flatnonzero(q_lens > 1):
        start, end = batch.query_start[s], batch.query_start[s + 1]
        out[start:end] = _prefill_attention(q[start:end], k_cache, v_cache, batch.block_tables[s],
                                            int(batch.context_lens[s]))
    return out.reshape(T, Hq, D)


def _gather(cache: np.ndarray, block_tables: np.ndarray, num_blocks: int) -> np.ndarray:
    # [num_blocks, Hk, bs, D] seen as [Hk, num_blocks, bs, D] and indexed on the blocks axis: one copy
    # that lands as [Hk, ..., n, D], each head's keys contiguous for the matmul.
    gathered = cache.transpose(1, 0, 2, 3)[:, block_tables[..., :num_blocks]]
    return gathered.reshape(*gathered.shape[:-3], -1, cache.shape[3])


def _prefill_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                       context_len: int) -> np.ndarray:
    q_len, Hk, G, D = q.shape
    num_blocks = -(-context_len // k_cache.shape[2])
    k = _gather(k_cache, block_table, num_blocks)[:, :context_len]  # float32[Hk, n, D]
    v = _gather(v_cache, block_table, num_blocks)[:, :context_len]
    scores = q.transpose(1, 2, 0, 3) @ k[:, None].transpose(0, 1, 3, 2)  # float32[Hk, G, q, n]
    # The first n - q keys are history every query sees; only the last q x q block is causal.
    causal = np.triu(np.full((q_len, q_len), -np.inf, dtype=np.float32), k=1)
    scores[..., context_len - q_len:] += causal
    return _softmax_times_v(scores, v[:, None]).transpose(2, 0, 1, 3)  # float32[q, Hk, G, D]


def _decode_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                      context_lens: np.ndarray) -> np.ndarray:
    S, Hk, G, D = q.shape
    block_size = k_cache.shape[2]
    num_blocks = -(-int(context_lens.max()) // block_size)
    k = _gather(k_cache, block_tables, num_blocks)  # float32[Hk, S, n, D], n = num_blocks * block_size
    v = _gather(v_cache, block_tables, num_blocks)
    scores = q.transpose(1, 0, 2, 3) @ k.transpose(0, 1, 3, 2)  # float32[Hk, S, G, n]
    padding = np.arange(k.shape[2]) >= context_lens[:, None]  # bool[S, n]: keys past each context
    scores += np.where(padding, np.float32(-np.inf), np.float32(0))[None, :, None, :]
    return _softmax_times_v(scores, v).transpose(1, 0, 2, 3)  # float32[S, Hk, G, D]


def _softmax_times_v(scores: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(scores) @ v over the last axis, in place on scores; normalized after the product."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    denominator = scores.sum(axis=-1, keepdims=True)
    out = scores @ v
    out /= denominator
    return out


def silu_and_mul(x: np.ndarray) -> np.ndarray:
    """float32[T, I] = silu(gate) * up for x = [gate | up] of float32[T, 2I]."""
    inter = x.shape[1] // 2
    gate, up = x[:, :inter], x[:, inter:]
    out = np.negative(gate)
    with np.errstate(over="ignore"):  # exp(-gate) -> inf for very negative gate gives silu = -0, correctly
        np.exp(out, out=out)
    out += 1
    np.divide(gate, out, out=out)
    out *= up
    return out
