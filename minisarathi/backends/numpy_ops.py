"""The reference backend: the ops of docs/architecture.md in float32 NumPy on the CPU.

Rows of `x` are tokens. Weights keep HF's [out, in] layout, so a linear layer is `x @ w.T`, which BLAS
reads as a transposed operand without a copy.
"""
from __future__ import annotations

import numpy as np

from minisarathi.batch import Batch
from minisarathi.sampler import Sampler

# Prefill attention runs this many query rows at a time: a tile skips the keys none of its rows can see
# (a fresh chunk does about half the work of the full square) and its scores stay small for long prompts.
QUERY_TILE = 128
_CAUSAL_TILE = np.triu(np.full((QUERY_TILE, QUERY_TILE), -np.inf, dtype=np.float32), k=1)  # built once


class NumpyOps:
    """The Backend interface (minisarathi/backends/base.py) on the CPU."""

    device = "cpu"
    activation_dtype = np.dtype(np.float32)   # of activations and the KV cache

    def free_memory_bytes(self) -> None:
        return None   # host memory: the engine uses its CPU default for the KV cache

    def new_sampler(self, vocab_size: int, seed: int = 0, eos_token_ids: tuple[int, ...] = ()) -> Sampler:
        return Sampler(vocab_size, seed, eos_token_ids)

    def weight(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array, dtype=np.float32)

    def upload_batch(self, batch: Batch) -> None:
        """Nothing to do: the batch's arrays are already where this backend computes."""

    def constant(self, array: np.ndarray) -> np.ndarray:
        return np.asarray(array, dtype=np.float32)

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    def embedding(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return np.take(table, ids, axis=0)  # float32[T, H]

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        mean_square = np.einsum("th,th->t", x, x) / x.shape[1]  # float32[T], no x*x temporary
        scale = 1.0 / np.sqrt(mean_square + np.float32(eps))
        out = x * scale[:, None]
        out *= w
        return out

    def add_rms_norm(self, x: np.ndarray, residual: np.ndarray, w: np.ndarray,
                     eps: float) -> tuple[np.ndarray, np.ndarray]:
        residual += x
        return self.rms_norm(residual, w, eps), residual

    def linear(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        out = x @ w.T  # float32[T, N]
        if bias is not None:
            out += bias
        return out

    def store_kv(self, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                 slot_mapping: np.ndarray) -> None:
        """Scatters token t's k[t], v[t] into slot slot_mapping[t]; a negative slot is padding, not stored."""
        stored = slot_mapping >= 0
        if not stored.all():
            k, v, slot_mapping = k[stored], v[stored], slot_mapping[stored]
        blocks, offsets = np.divmod(slot_mapping, k_cache.shape[2])
        # Caches are [num_blocks, Hk, block_size, D]; indexing axes 0 and 2 selects [T, Hk, D].
        k_cache[blocks, :, offsets] = k
        v_cache[blocks, :, offsets] = v

    def paged_attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, batch: Batch,
                        scale: float) -> np.ndarray:
        """float32[T, Hq, D]: each query attends causally to its own sequence's keys in the paged cache.

        Single-token runs (decodes) are done together, padded to the longest context (the padding reads
        block-table entries past a context and masks them out, so the cache must hold finite numbers, as
        zeros() and a finite model keep it); longer runs (prefill chunks) one sequence at a time. GQA never
        copies K/V per query head: queries are grouped as [Hk, G] and the G queries of a KV head share its
        keys in one product.
        """
        T, Hq, D = q.shape
        Hk = k_cache.shape[1]
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

    def rope_store_kv(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      positions: np.ndarray, slot_mapping: np.ndarray, cos_sin: np.ndarray) -> None:
        """Rotates q[T, Hq, D] in place and writes the rotated k[T, Hk, D] and v into the cache at slot_mapping
        (negative slot: not stored); k and v are left as they are. cos_sin: config.rope_cos_sin() (float32[P, D]);
        pairs are (i, i + D/2) as in HF's rotate_half."""
        half = q.shape[2] // 2
        table = cos_sin[positions]                                   # float32[T, D]
        cos, sin = table[:, None, :half], table[:, None, half:]
        q1, q2 = q[..., :half], q[..., half:]
        rotated_q1 = q1 * cos - q2 * sin
        q2 *= cos
        q2 += q1 * sin
        q1[...] = rotated_q1
        k1, k2 = k[..., :half], k[..., half:]
        rotated_k = np.concatenate([k1 * cos - k2 * sin, k2 * cos + k1 * sin], axis=2)   # float32[T, Hk, D]
        self.store_kv(rotated_k, v, k_cache, v_cache, slot_mapping)

    def copy_blocks(self, kv_cache: list[tuple[np.ndarray, np.ndarray]], sources: list[int],
                    destinations: list[int]) -> None:
        for k_cache, v_cache in kv_cache:
            k_cache[destinations] = k_cache[sources]
            v_cache[destinations] = v_cache[sources]

    def silu_and_mul(self, x: np.ndarray) -> np.ndarray:
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


def _prefill_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                       context_len: int) -> np.ndarray:
    q_len, Hk, _, D = q.shape
    history = context_len - q_len  # keys every query of the chunk sees
    blocks = block_table[:-(-context_len // k_cache.shape[2])]
    # One sequence's blocks laid out as [Hk, n, D]: each head's keys one matrix for the matmuls.
    k = np.take(k_cache, blocks, axis=0).transpose(1, 0, 2, 3).reshape(Hk, 1, -1, D)[:, :, :context_len]
    v = np.take(v_cache, blocks, axis=0).transpose(1, 0, 2, 3).reshape(Hk, 1, -1, D)[:, :, :context_len]
    out = np.empty_like(q)  # float32[q, Hk, G, D]
    for start in range(0, q_len, QUERY_TILE):
        end = min(start + QUERY_TILE, q_len)
        visible = history + end
        scores = q[start:end].transpose(1, 2, 0, 3) @ k[:, :, :visible].transpose(0, 1, 3, 2)  # [Hk, G, t, visible]
        scores[..., history + start:] += _CAUSAL_TILE[:end - start, :end - start]
        denominator = _exp_in_place(scores)
        tile = scores @ v[:, :, :visible]  # float32[Hk, G, t, D]
        tile /= denominator
        out[start:end] = tile.transpose(2, 0, 1, 3)
    return out


def _decode_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                      context_lens: np.ndarray) -> np.ndarray:
    S, Hk, G, D = q.shape
    block_size = k_cache.shape[2]
    num_blocks = -(-int(context_lens.max()) // block_size)
    n = num_blocks * block_size
    # Whole blocks are the cheapest gather (one contiguous [Hk, bs, D] run each), so the products are
    # taken block by block and only the small scores array is reordered for the softmax.
    k = np.take(k_cache, block_tables[:, :num_blocks], axis=0)  # float32[S, nb, Hk, bs, D]
    v = np.take(v_cache, block_tables[:, :num_blocks], axis=0)
    scores = q[:, None] @ k.swapaxes(-1, -2)  # float32[S, nb, Hk, G, bs]
    scores = scores.transpose(0, 2, 3, 1, 4).reshape(S, Hk, G, n)
    padding = np.arange(n) >= context_lens[:, None]  # bool[S, n]: keys past each context
    scores += np.where(padding, np.float32(-np.inf), np.float32(0))[:, None, None, :]
    denominator = _exp_in_place(scores)
    probs = scores.reshape(S, Hk, G, num_blocks, block_size).transpose(0, 3, 1, 2, 4)  # [S, nb, Hk, G, bs]
    out = (probs @ v).sum(axis=1)  # float32[S, Hk, G, D]
    out /= denominator
    return out


def _exp_in_place(scores: np.ndarray) -> np.ndarray:
    """The softmax numerator over the last axis, in place; returns the denominator, which is applied
    after the product with V (on D numbers per row instead of n)."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    return scores.sum(axis=-1, keepdims=True)
