"""Paged attention for the NumPy backend: the K/V tiles a batch reads, gathered head-major into reused buffers.

The cache is [num_blocks, Hk, block_size, D], so the [block_size, D] tile of block b and KV head h is row
b * Hk + h of the cache seen as [num_blocks * Hk, block_size, D]. Gathering the tiles of a sequence in
(head, block) order gives its keys as one [Hk, n, D] matrix per head: the scores of every decode of the batch
then come from one batched matmul, [S, Hk, G, D] @ [S, Hk, D, n], and need no reordering for the softmax.

What every layer of a step shares (the tile indices, the padding mask) is computed once per batch
(AttentionPlan), and the gathered tiles land in buffers that live across layers and steps (GatherBuffers):
a fresh [S, Hk, n, D] array per layer costs page faults as large as the copy itself. Decode K/V too large to
stay in the CPU's cache between the gather and the products is kept from one step to the next instead
(DecodeKV): a step then copies only what was written since, typically each sequence's last block.
"""
from __future__ import annotations

import numpy as np

from minisarathi.batch import Batch

# Decodes run in groups whose gathered K and V take about this many bytes: a group's tiles are still in the
# cache when its two products read them (on the 2-core EPYC VM, 32 MiB L3: 21% faster at 2 MiB of K/V per
# sequence than one group of 32, no change for short contexts; bench/decode_attention_variants.py).
DECODE_GROUP_BYTES = 6 << 20
# Prefill attention runs this many query rows at a time: a tile skips the keys none of its rows can see
# (a fresh chunk does about half the work of the full square) and its scores stay small for long prompts.
QUERY_TILE = 128
_CAUSAL_TILE = np.triu(np.full((QUERY_TILE, QUERY_TILE), -np.inf, dtype=np.float32), k=1)  # built once


def cache_tiles(block_table: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """int[..., Hk, B]: the rows of the [num_blocks * Hk, block_size, D] cache view holding each head's keys
    of the blocks in block_table[..., B], head by head."""
    return block_table[..., None, :] * num_kv_heads + np.arange(num_kv_heads, dtype=block_table.dtype)[:, None]


class AttentionPlan:
    """Per batch, for every layer alike: which rows decode, which tiles each run reads, the decode padding."""

    def __init__(self, batch: Batch, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int):
        self.batch = batch
        self.cache_shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self._arrays = (batch.query_start, batch.context_lens, batch.block_tables)
        q_lens = np.diff(batch.query_start)
        decodes = np.flatnonzero(q_lens == 1)
        # The engine puts decodes first: then their rows are a slice and q, out are views, not copies.
        first_are_decodes = decodes[-1:].tolist() == [len(decodes) - 1]
        self.decode_rows = slice(0, len(decodes)) if first_are_decodes else batch.query_start[decodes]
        self.num_decodes = len(decodes)
        self.keeps_decode_kv = False
        if self.num_decodes:
            context_lens = batch.context_lens[decodes]
            blocks_per_seq = -(-int(context_lens.max()) // block_size)
            n = blocks_per_seq * block_size
            self.decode_tiles = cache_tiles(batch.block_tables[decodes, :blocks_per_seq], num_kv_heads).ravel()
            self.decode_keys = n
            self.decode_group = max(1, DECODE_GROUP_BYTES // (2 * num_kv_heads * n * head_dim * 4))
            # float32[S, 1, 1, n]: -inf on the keys past each context (padding reads whatever the
            # block-table entries past a context name, so the cache must hold finite numbers)
            self.decode_mask = np.where(np.arange(n) >= context_lens[:, None], np.float32(-np.inf),
                                        np.float32(0))[:, None, None, :]
            # Decode K/V that fits one group is gathered again each step: it stays in the cache for the
            # products, and is cheaper in NumPy calls than finding what changed. Larger, it is kept across
            # steps (DecodeKV) while its padded tiles are no more than the pool holds (the copy then costs
            # at most the KV cache's memory again); past that, it is gathered group by group.
            decode_bytes = 2 * len(self.decode_tiles) * block_size * head_dim * 4
            self.keeps_decode_kv = (DECODE_GROUP_BYTES < decode_bytes
                                    and len(self.decode_tiles) <= num_blocks * num_kv_heads)
        self.prefills = []    # (first row, last row + 1, tiles, context length) per longer run
        for s in np.flatnonzero(q_lens > 1).tolist():
            context_len = int(batch.context_lens[s])
            table = batch.block_tables[s, :-(-context_len // block_size)]
            self.prefills.append((int(batch.query_start[s]), int(batch.query_start[s + 1]),
                                  cache_tiles(table, num_kv_heads).ravel(), context_len))


    def describes(self, batch: Batch, k_cache: np.ndarray) -> bool:
        """Whether this plan is for `batch` (the same object, its arrays not replaced) and caches like k_cache."""
        return (batch is self.batch and k_cache.shape == self.cache_shape
                and all(a is b for a, b in zip(self._arrays, (batch.query_start, batch.context_lens,
                                                               batch.block_tables))))


class GatherBuffers:
    """Two grow-only float32 buffers the gathered K and V tiles land in, reused by every layer and step."""

    def __init__(self):
        self._k = self._v = np.empty(0, np.float32)

    def gather(self, k_cache: np.ndarray, v_cache: np.ndarray, tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32[len(tiles), block_size, D] each: the K and V tiles, in the buffers (valid until the next call)."""
        num_blocks, Hk, block_size, D = k_cache.shape
        size = len(tiles) * block_size * D
        if self._k.size < size:
            self._k, self._v = np.empty(size, np.float32), np.empty(size, np.float32)
        shape = (len(tiles), block_size, D)
        k, v = self._k[:size].reshape(shape), self._v[:size].reshape(shape)
        # mode="clip": with out=, the default "raise" copies through a temporary buffer; the indices are valid
        np.take(k_cache.reshape(num_blocks * Hk, block_size, D), tiles, axis=0, out=k, mode="clip")
        np.take(v_cache.reshape(num_blocks * Hk, block_size, D), tiles, axis=0, out=v, mode="clip")
        return k, v


class DecodeKV:
    """One layer's decode K/V tiles, kept gathered from one step to the next: a step re-copies only the tiles
    that changed (a block written since it was copied, or another tile at that place: the decode batch
    changed), typically each sequence's last block. The cache must be written only through
    NumpyOps.store_kv, which reports the blocks it writes (written()). Costs memory: a second copy of the
    decode batch's K/V, at most the KV pool's size."""

    def __init__(self, k_cache: np.ndarray):
        num_blocks, _, block_size, D = k_cache.shape
        self._clock = 0                                         # counts this layer's store_kv calls
        self._block_written = np.zeros(num_blocks, np.int64)    # the clock at each block's last write
        self._tiles = np.empty(0, np.int64)                     # the tile each entry holds (-1: none)
        self._copied = np.empty(0, np.int64)                    # the clock when each entry was copied
        self._k = self._v = np.empty((0, block_size, D), np.float32)

    def written(self, blocks: np.ndarray) -> None:
        self._clock += 1
        self._block_written[blocks] = self._clock

    def gather(self, k_cache: np.ndarray, v_cache: np.ndarray, tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32[len(tiles), block_size, D] each: the K and V tiles (valid until the next call)."""
        num_blocks, Hk, block_size, D = k_cache.shape
        m = len(tiles)
        if len(self._tiles) < m:      # grow by a quarter at least (contexts grow), to the pool's size at most
            size = min(max(m, len(self._tiles) * 5 // 4), num_blocks * Hk)
            self._tiles, self._copied = np.full(size, -1, np.int64), np.zeros(size, np.int64)
            self._k, self._v = (np.empty((size, block_size, D), np.float32) for _ in range(2))
        stale = np.flatnonzero((self._tiles[:m] != tiles) | (self._block_written[tiles // Hk] > self._copied[:m]))
        k, v = self._k[:m], self._v[:m]
        k_tiles = k_cache.reshape(num_blocks * Hk, block_size, D)
        v_tiles = v_cache.reshape(num_blocks * Hk, block_size, D)
        if len(stale) == m:
            # mode="clip": with out=, the default "raise" copies through a temporary; the indices are valid
            np.take(k_tiles, tiles, axis=0, out=k, mode="clip")
            np.take(v_tiles, tiles, axis=0, out=v, mode="clip")
        elif len(stale):
            k[stale] = k_tiles[tiles[stale]]
            v[stale] = v_tiles[tiles[stale]]
        self._tiles[:m] = tiles
        self._copied[stale] = self._clock
        return k, v


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, plan: AttentionPlan,
                    buffers: GatherBuffers, scale: float, decode_kv: DecodeKV | None = None) -> np.ndarray:
    """float32[T, Hq, D]: each query attends causally to its own sequence's keys in the paged cache.

    Single-token runs (decodes) are done together, padded to the longest context; longer runs (prefill chunks)
    one sequence at a time. GQA never copies K/V per query head: queries are grouped as [Hk, G] and the G
    queries of a KV head share its keys in one product.
    """
    T, Hq, D = q.shape
    Hk = k_cache.shape[1]
    G = Hq // Hk
    q = (q * np.float32(scale)).reshape(T, Hk, G, D)
    out = np.empty((T, Hk, G, D), dtype=np.float32)
    if plan.num_decodes:
        q_decode = q[plan.decode_rows]                        # float32[S, Hk, G, D]
        out_decode = out[plan.decode_rows] if isinstance(plan.decode_rows, slice) else np.empty_like(q_decode)
        tiles_per_seq = len(plan.decode_tiles) // plan.num_decodes
        if decode_kv is not None:
            kept = decode_kv.gather(k_cache, v_cache, plan.decode_tiles)
        group = plan.num_decodes if decode_kv is not None else plan.decode_group
        for first in range(0, plan.num_decodes, group):
            rows = slice(first, min(first + group, plan.num_decodes))
            entries = slice(rows.start * tiles_per_seq, rows.stop * tiles_per_seq)
            k, v = (kept[0][entries], kept[1][entries]) if decode_kv is not None else \
                buffers.gather(k_cache, v_cache, plan.decode_tiles[entries])
            k, v = k.reshape(-1, Hk, plan.decode_keys, D), v.reshape(-1, Hk, plan.decode_keys, D)
            scores = q_decode[rows] @ k.swapaxes(-1, -2)      # float32[s, Hk, G, n]
            scores += plan.decode_mask[rows]
            denominator = _exp_in_place(scores)
            np.matmul(scores, v, out=out_decode[rows])        # float32[s, Hk, G, D]
            out_decode[rows] /= denominator
        if not isinstance(plan.decode_rows, slice):
            out[plan.decode_rows] = out_decode
    for start, end, tiles, context_len in plan.prefills:
        k, v = buffers.gather(k_cache, v_cache, tiles)
        k, v = k.reshape(Hk, 1, -1, D), v.reshape(Hk, 1, -1, D)   # [Hk, 1, n, D]: padding past context_len
        _prefill_attention(q[start:end], k, v, context_len, out[start:end])
    return out.reshape(T, Hq, D)


def _prefill_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, context_len: int, out: np.ndarray) -> None:
    q_len = q.shape[0]
    history = context_len - q_len  # keys every query of the chunk sees
    for start in range(0, q_len, QUERY_TILE):
        end = min(start + QUERY_TILE, q_len)
        visible = history + end
        scores = q[start:end].transpose(1, 2, 0, 3) @ k[:, :, :visible].swapaxes(-1, -2)  # [Hk, G, t, visible]
        scores[..., history + start:] += _CAUSAL_TILE[:end - start, :end - start]
        denominator = _exp_in_place(scores)
        tile = scores @ v[:, :, :visible]  # float32[Hk, G, t, D]
        tile /= denominator
        out[start:end] = tile.transpose(2, 0, 1, 3)


def _exp_in_place(scores: np.ndarray) -> np.ndarray:
    """The softmax numerator over the last axis, in place; returns the denominator, which is applied
    after the product with V (on D numbers per row instead of n)."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    return scores.sum(axis=-1, keepdims=True)
