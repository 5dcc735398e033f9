"""Paged attention for the CPU backend: the K/V tiles a batch reads, gathered head-major into reused buffers.

Prefill chunks always run here. Decodes run on the native kernel (native_attention.py) where it runs for the
model (native_attention.runs; the plan then holds only its DecodeRows); what follows is their path elsewhere,
which is also the reference the kernel is tested beside.

The cache is [num_blocks, Hk, block_size, D], so the [block_size, D] tile of block b and KV head h is row
b * Hk + h of the cache seen as [num_blocks * Hk, block_size, D]. Gathering the tiles of a sequence in
(head, block) order gives its keys as one [Hk, n, D] matrix per head: the scores of every decode of the batch
then come from one batched matmul, [S, Hk, G, D] @ [S, Hk, D, n], and need no reordering for the softmax.

What every layer of a step shares (the tile indices, the padding mask) is computed once per batch
(AttentionPlan), and the gathered tiles land in buffers that live across layers and steps (GatherBuffers):
a fresh [S, Hk, n, D] array per layer costs page faults as large as the copy itself. Decode K/V larger than
one gather group (DECODE_GROUP_BYTES) is kept from one step to the next instead (DecodeKV): a step then copies
only what was written since, typically each sequence's last block, instead of every block of every layer.
Its memory (kept_memory) is made with the cache, room for the pool's blocks, and partly written then, so
that the step that starts keeping (which copies it all) allocates nothing and faults in no page.
"""

from __future__ import annotations

import mmap

import numpy as np

from minisarathi.backends.cpu.native_attention import CpuAttention, DecodeRows
from minisarathi.batch import Batch

# Decodes whose K/V is not kept (it fits one group, or it has more padded blocks than the pool has) are
# gathered each step, in groups whose K and V take about this many bytes: a group's tiles are still in the
# CPU's last-level cache when its two products read them (docs/cpu_performance.md, "Decode attention").
DECODE_GROUP_BYTES = 6 << 20
# From this many keys on, decode scores are computed transposed, as K @ q^T (n rows by G columns) rather than
# q @ K^T (G rows by n columns), then laid out [G, n] for the softmax: OpenBLAS's AVX-512 kernels do the
# few-rows product slower there; below it the few-rows product is as fast or faster.
TRANSPOSED_SCORES_KEYS = 384
# Prefill attention runs this many query rows at a time: a tile skips the keys none of its rows can see
# (a fresh chunk does about half the work of the full square) and its scores stay in L2 for long prompts,
# with still few calls per chunk.
QUERY_TILE = 64
# Runs of up to this many tokens go to the native decode kernel as one decode per query (where it runs): a
# speculative verification chunk costs one call there instead of a NumPy product per sequence and layer.
NATIVE_RUN_TOKENS = 8
_CAUSAL_TILE = np.triu(np.full((QUERY_TILE, QUERY_TILE), -np.inf, dtype=np.float32), k=1)  # built once


def cache_tiles(block_table: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """int[..., Hk, B]: the rows of the [num_blocks * Hk, block_size, D] cache view holding each head's keys
    of the blocks in block_table[..., B], head by head."""
    heads = np.arange(num_kv_heads, dtype=block_table.dtype)[:, None]  # int[Hk, 1]
    return block_table[..., None, :] * num_kv_heads + heads


class AttentionPlan:
    """Per batch, for every layer alike: which rows decode, which tiles each run reads, the decode padding."""

    def __init__(
        self,
        batch: Batch,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        native_query_heads: int | None = None,
    ):
        """native_query_heads: Hq, where the decodes run on the native kernel (native_attention.py), which
        reads the cache in place: no tiles, mask or kept K/V are planned for them; None: they run on NumPy."""
        self.batch = batch
        self.cache_shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self._arrays = (batch.query_start, batch.context_lens, batch.block_tables)
        q_lens = np.diff(batch.query_start)
        decodes = self.decodes = np.flatnonzero(q_lens == 1)
        self._window_masks: dict[int, np.ndarray] = {}  # window -> window_mask(window)
        # the native kernel also takes short runs (speculation's verification chunks), a decode per query
        longest_decode_run = 1 if native_query_heads is None else NATIVE_RUN_TOKENS
        native_runs = np.flatnonzero(q_lens <= longest_decode_run)
        self.native_decodes = (
            None
            if native_query_heads is None or not len(native_runs)
            else DecodeRows(batch, native_runs, self.cache_shape, native_query_heads)
        )
        # The engine puts decodes first: then their rows are a slice and q, out are views, not copies.
        first_are_decodes = decodes[-1:].tolist() == [len(decodes) - 1]
        self.decode_rows = slice(0, len(decodes)) if first_are_decodes else batch.query_start[decodes]
        self.num_decodes = len(decodes)
        self.keeps_decode_kv = False
        if self.num_decodes and self.native_decodes is None:
            context_lens = batch.context_lens[decodes]
            longest = int(context_lens.max())
            blocks_per_seq = -(-longest // block_size)
            self.decode_blocks = batch.block_tables[decodes, :blocks_per_seq]  # int[S, B]
            # bool[S, B]: the entries within each context (past it, the table's padding: masked out)
            self.decode_blocks_used = np.arange(blocks_per_seq) < -(-context_lens[:, None] // block_size)
            self.decode_keys = longest  # the products read no key past the longest context
            # float32[S, 1, 1, longest]: -inf on the keys past each context (padding reads whatever the
            # block-table entries past a context name, so the cache must hold finite numbers); None when
            # every context is the longest (a burst of equal requests)
            self.decode_mask = (
                None
                if (context_lens == longest).all()
                else np.where(
                    np.arange(longest) >= context_lens[:, None], np.float32(-np.inf), np.float32(0)
                )[:, None, None, :]
            )
            # Decode K/V that fits one group is gathered again each step: the copy brings it into the CPU's
            # cache just before the products read it (kept across steps, the products would read it from
            # memory). Larger, it is kept across steps (DecodeKV: a step copies only the blocks written
            # since, each sequence's last one) while its padded blocks are no more than the pool holds (the
            # copy costs at most the KV cache's memory again); past that, it is gathered each step, group by
            # group.
            decode_bytes = 2 * self.decode_blocks.size * num_kv_heads * block_size * head_dim * 4
            self.keeps_decode_kv = DECODE_GROUP_BYTES < decode_bytes and self.decode_blocks.size <= num_blocks
            self.decode_tiles = cache_tiles(self.decode_blocks, num_kv_heads).ravel()
            self.decode_group = max(
                1,
                DECODE_GROUP_BYTES
                // (
                    2 * self.decode_blocks.size // self.num_decodes * num_kv_heads * block_size * head_dim * 4
                ),
            )
        self.prefills = []  # (first row, last row + 1, tiles, context length) per longer run
        for s in np.flatnonzero(q_lens > longest_decode_run).tolist():
            context_len = int(batch.context_lens[s])
            table = batch.block_tables[s, : -(-context_len // block_size)]
            self.prefills.append(
                (
                    int(batch.query_start[s]),
                    int(batch.query_start[s + 1]),
                    cache_tiles(table, num_kv_heads).ravel(),
                    context_len,
                )
            )

    def window_mask(self, window: int) -> np.ndarray:
        """float32[S, 1, 1, decode_keys]: -inf on each decode's keys at or before its position - window
        (keys before context_len - window), made once per window and batch."""
        mask = self._window_masks.get(window)
        if mask is None:
            first = self.batch.context_lens[self.decodes] - window  # int[S]: each one's first visible key
            hidden = np.arange(self.decode_keys) < first[:, None]
            mask = np.where(hidden, np.float32(-np.inf), np.float32(0))
            mask = self._window_masks[window] = mask[:, None, None]
        return mask

    def describes(self, batch: Batch, k_cache: np.ndarray) -> bool:
        """Whether this plan is for `batch` (the same object, its arrays not replaced) and caches like
        k_cache."""
        query_start, context_lens, block_tables = self._arrays
        return (
            batch is self.batch
            and k_cache.shape == self.cache_shape
            and batch.query_start is query_start
            and batch.context_lens is context_lens
            and batch.block_tables is block_tables
        )


class GatherBuffers:
    """Two grow-only float32 buffers the gathered K and V tiles land in, reused by every layer and step."""

    def __init__(self):
        self._k = self._v = np.empty(0, np.float32)

    def gather(
        self, k_cache: np.ndarray, v_cache: np.ndarray, tiles: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """float32[len(tiles), block_size, D] each: the K and V tiles, in the buffers (valid until the next
        call)."""
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
    """One layer's decode K/V, kept gathered from one step to the next as [rows, Hk, B, block_size, D]: row r,
    column j holds block block_tables[r, j] of the decode batch, all heads, so [:S] seen as
    [S, Hk, B * block_size, D] is every decode's keys head by head (a view: no copy). A step re-copies only
    the (row, column) blocks that changed: a block written since it was copied (in steady decoding, each
    sequence's last block) or another block at that place (a sequence finished or joined). When B changes
    (the longest context enters a new block: at most every block_size steps), all is laid out anew in the same
    memory and copied in one take per cache: the products read contiguous [B * block_size, D] matrices
    (strided ones with room for more blocks cost 5% more). The cache must be written only through
    CpuOps.store_kv or copy_blocks, which report the blocks they write (written()).

    memory: two float32[k_cache.size] from kept_memory(), for K and V: room for as many blocks as the pool
    (AttentionPlan keeps decode K/V only when its S * B blocks fit the pool); no step allocates."""

    def __init__(self, k_cache: np.ndarray, memory: tuple[np.ndarray, np.ndarray]):
        num_blocks, Hk, block_size, D = k_cache.shape
        self._clock = 0  # counts this layer's reported writes
        self._block_written = np.zeros(num_blocks, np.int64)  # the clock at each block's last write
        self._held = np.empty((0, 0), np.int64)  # [rows, B]: the block each place holds, -1 none
        self._copied = np.empty((0, 0), np.int64)  # [rows, B]: the clock when it was copied
        self._memory = memory
        self._k = self._v = np.empty((0, Hk, 0, block_size, D), np.float32)

    def written(self, blocks: np.ndarray) -> None:
        self._clock += 1
        self._block_written[blocks] = self._clock

    def gather(
        self, k_cache: np.ndarray, v_cache: np.ndarray, blocks: np.ndarray, used: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """float32[S, Hk, B * block_size, D] each: the K and V of blocks (int[S, B], each decode's block-table
        entries) head by head, views valid until the next call. Between changes of B only the entries where
        used (bool[S, B]) are copied: the others are padding, masked out, which needs only finite numbers (the
        memory starts as zeros and receives nothing but copies of the cache)."""
        num_blocks, Hk, block_size, D = k_cache.shape
        S, B = blocks.shape
        if B != self._held.shape[1]:
            self._lay_out(num_blocks // B, B)
            tiles = cache_tiles(blocks, Hk).ravel()  # int[S * Hk * B]: the memory's order
            for cache, kept in ((k_cache, self._k), (v_cache, self._v)):
                # mode="clip": with out=, the default "raise" copies through a temporary buffer
                np.take(
                    cache.reshape(num_blocks * Hk, block_size, D),
                    tiles,
                    axis=0,
                    mode="clip",
                    out=kept[:S].reshape(S * Hk * B, block_size, D),
                )
            self._held[:S], self._copied[:S] = blocks, self._clock
        else:
            held = self._held[:S]
            stale = (held != blocks) | (self._block_written[blocks] > self._copied[:S])
            stale_rows, stale_columns = np.nonzero(stale & used)
            if len(stale_rows):
                source = blocks[stale_rows, stale_columns]
                self._k[stale_rows, :, stale_columns] = k_cache[source]  # [stale, Hk, block_size, D]
                self._v[stale_rows, :, stale_columns] = v_cache[source]
                held[stale_rows, stale_columns] = source
                self._copied[stale_rows, stale_columns] = self._clock
        shape = (S, Hk, B * block_size, D)
        return self._k[:S].reshape(shape), self._v[:S].reshape(shape)

    def _lay_out(self, rows: int, B: int) -> None:
        """The memory seen as [rows, Hk, B, block_size, D], holding no block yet."""
        _, Hk, _, block_size, D = self._k.shape
        self._held, self._copied = np.full((rows, B), -1, np.int64), np.zeros((rows, B), np.int64)
        self._k, self._v = (
            memory[: rows * Hk * B * block_size * D].reshape(rows, Hk, B, block_size, D)
            for memory in self._memory
        )


def kept_memory(size: int) -> np.ndarray:
    """float32[size] of zeros for DecodeKV, in an anonymous mapping of its own, its first DECODE_GROUP_BYTES
    written now (CpuOps.zeros makes one with each KV-cache array); the rest is faulted in where kept decode
    K/V first grows into it, a few blocks at a time (a column when B grows, a row when a decode joins).

    Why: the step that first keeps decode K/V copies all of it, over DECODE_GROUP_BYTES / 2 into each of the
    K and V memories (more where decodes joined several at a time; the prefix written now is twice that).
    Memory allocated in that step would make it the slowest of its burst: page faults on the kept K/V's own
    pages, and buffers taken from the heap in a step push the forward's temporaries onto fresh pages.
    Writing it all now would double the KV pool's resident memory for the rare batch that fills the pool.
    Transparent huge pages, as NumPy asks for its own large arrays: the products read them faster."""
    mapping = mmap.mmap(-1, max(size, 1) * 4, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        mapping.madvise(mmap.MADV_HUGEPAGE)
    memory = np.frombuffer(mapping, np.float32)
    memory[: DECODE_GROUP_BYTES // 4] = 0  # faults those pages in
    return memory


def paged_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    plan: AttentionPlan,
    buffers: GatherBuffers,
    scale: float,
    window: int | None = None,
    decode_kv: DecodeKV | None = None,
    native: tuple[CpuAttention, tuple[int, int]] | None = None,
) -> np.ndarray:
    """float32[T, Hq, D]: each query attends causally to its own sequence's keys in the paged cache; with a
    sliding window, only to keys past its position - window.

    Single-token runs (decodes) are done together: by the native kernel where the plan says so (native: the
    kernel and the caches' data addresses; it also takes runs of up to NATIVE_RUN_TOKENS, a decode per query),
    else padded to the longest context; longer runs (prefill chunks) one sequence at a time. GQA never
    copies K/V per query head: queries are grouped as [Hk, G] and the G queries of a KV head share its keys
    in one product.
    """
    T, Hq, D = q.shape
    Hk, block_size = k_cache.shape[1:3]
    G = Hq // Hk
    out = np.empty((T, Hk, G, D), dtype=np.float32)
    if plan.native_decodes is not None:
        kernel, cache_addresses = native
        kernel.decode(q, cache_addresses, plan.native_decodes, scale, out.reshape(T, Hq, D), window)
    if plan.prefills or plan.num_decodes and plan.native_decodes is None:
        q = (q * np.float32(scale)).reshape(T, Hk, G, D)
    if plan.num_decodes and plan.native_decodes is None:
        q_decode = q[plan.decode_rows]  # float32[S, Hk, G, D]
        if plan.decode_keys >= TRANSPOSED_SCORES_KEYS:
            q_decode_t = np.ascontiguousarray(q_decode.swapaxes(-1, -2))  # float32[S, Hk, D, G]
        out_decode = out[plan.decode_rows] if isinstance(plan.decode_rows, slice) else np.empty_like(q_decode)
        if decode_kv is not None:
            kept = decode_kv.gather(k_cache, v_cache, plan.decode_blocks, plan.decode_blocks_used)
            group = plan.num_decodes
        else:
            group, tiles_per_seq = plan.decode_group, len(plan.decode_tiles) // plan.num_decodes
        for first in range(0, plan.num_decodes, group):
            rows = slice(first, min(first + group, plan.num_decodes))
            if decode_kv is not None:
                k, v = kept  # float32[S, Hk, B * block_size, D] each
            else:
                entries = slice(rows.start * tiles_per_seq, rows.stop * tiles_per_seq)
                k, v = buffers.gather(k_cache, v_cache, plan.decode_tiles[entries])
                shape = (-1, Hk, tiles_per_seq // Hk * block_size, D)
                k, v = k.reshape(shape), v.reshape(shape)
            k, v = k[:, :, : plan.decode_keys], v[:, :, : plan.decode_keys]
            # transposed: [s, Hk, n, D] @ [s, Hk, D, G], then laid out [s, Hk, G, n]
            if plan.decode_keys >= TRANSPOSED_SCORES_KEYS:
                scores = np.ascontiguousarray((k @ q_decode_t[rows]).swapaxes(-1, -2))
            else:
                scores = q_decode[rows] @ k.swapaxes(-1, -2)  # float32[s, Hk, G, n]
            if plan.decode_mask is not None:
                scores += plan.decode_mask[rows]
            if window is not None:
                scores += plan.window_mask(window)[rows]
            denominator = _exp_in_place(scores)
            np.matmul(scores, v, out=out_decode[rows])  # float32[s, Hk, G, D]
            out_decode[rows] /= denominator
        if not isinstance(plan.decode_rows, slice):
            out[plan.decode_rows] = out_decode
    for start, end, tiles, context_len in plan.prefills:
        if window is not None:  # only the blocks from the first query's window on (those before may be freed)
            skipped = max(0, context_len - (end - start) - window + 1) // block_size
            tiles = tiles.reshape(Hk, -1)[:, skipped:].ravel()
            context_len -= skipped * block_size  # keys counted from the first gathered one: the same masks
        k, v = buffers.gather(k_cache, v_cache, tiles)
        k, v = k.reshape(Hk, 1, -1, D), v.reshape(Hk, 1, -1, D)  # [Hk, 1, n, D]: padding past context_len
        _prefill_attention(q[start:end], k, v, context_len, out[start:end], window)
    return out.reshape(T, Hq, D)


def _prefill_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, context_len: int, out: np.ndarray, window: int | None
) -> None:
    q_len = q.shape[0]
    history = context_len - q_len  # keys every query of the chunk sees (without a window)
    for start in range(0, q_len, QUERY_TILE):
        end = min(start + QUERY_TILE, q_len)
        visible = history + end
        # a window: the tile reads from its first row's first key; the rows after it see fewer
        first = 0 if window is None else max(0, history + start - window + 1)
        # float32[Hk, G, t, visible - first]
        scores = q[start:end].transpose(1, 2, 0, 3) @ k[:, :, first:visible].swapaxes(-1, -2)
        scores[..., history + start - first :] += _CAUSAL_TILE[: end - start, : end - start]
        if window is not None:
            positions = np.arange(history + start, history + end)[:, None]  # int[t, 1]
            keys = np.arange(first, visible)  # int[visible - first]
            scores += np.where(keys <= positions - window, np.float32(-np.inf), np.float32(0))
        denominator = _exp_in_place(scores)
        tile = scores @ v[:, :, first:visible]  # float32[Hk, G, t, D]
        tile /= denominator
        out[start:end] = tile.transpose(2, 0, 1, 3)


def _exp_in_place(scores: np.ndarray) -> np.ndarray:
    """The softmax numerator over the last axis, in place; returns the denominator, which is applied
    after the product with V (on D numbers per row instead of n)."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    return np.einsum("...n->...", scores)[..., None]  # the sum: einsum is faster than .sum(axis=-1) here
