"""The host side of cuda/decode_attention.cu: which CTAs to launch for the decode rows of a batch.

Flash-decoding cuts each row's keys into splits so that the grid fills the GPU. The host fixes only how many
splits each row has; the kernels derive each split's keys from the row's context length on the device
(split_length, mirrored here), so a plan holds for any lengths and a CUDA graph's plan follows every step's:
- eagerly (`plan`), from the step's lengths: one target split length for the batch, from the total work, for
  about WAVES waves on the device's multiprocessors but no split under MIN_SPLIT_KEYS; each row then gets
  as many splits as it fills, so none is empty and long rows get more;
- for a graph's batch-size bucket (`bucket_plan`), lengths unknown: the same number of splits in every row,
  about WAVES waves for the bucket's rows, whatever max_model_len is. A row uses the first ceil(len /
  split_length) of them; the others exit at once.
Only rows with several splits own partial slots, so the partial buffers are sized by the rows that split.
Splits have no upper length: a CTA stages the block-table entries of SEGMENT_KEYS keys at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minisarathi.backends.kernel_source import kernel_constants

DA = kernel_constants("decode_attention.cu")
THREADS, STAGES = DA["DA_THREADS"], DA["DA_STAGES"]
MAX_HEAD_DIM = 32 * DA["DA_LANE_ELEMENTS"]  # 32 lanes own a key row
GROUP_TILES = {"float32": (4,), "float16": (4, 8), "bfloat16": (4, 8)}  # instantiated query heads per CTA
LANES = (8, 16, 32)  # instantiated threads per key row
# Every instantiation (dtype, query heads per CTA, lanes per key row) of decode_attention_kernel.
INSTANTIATIONS = [
    (dtype, tile, lanes) for dtype, tiles in GROUP_TILES.items() for tile in tiles for lanes in LANES
]


def tile_keys(itemsize: int) -> int:
    return DA["DA_TILE_KEYS_FLOAT"] if itemsize == 4 else DA["DA_TILE_KEYS_16BIT"]


WAVES = 2
CTAS_PER_MULTIPROCESSOR = (
    4  # resident decode CTAs per SM at head_dim 128 (registers and shared memory; docs/performance.md)
)
MIN_SPLIT_KEYS, SPLIT_ALIGN, SEGMENT_KEYS = (
    DA["DA_MIN_SPLIT_KEYS"],
    DA["DA_SPLIT_ALIGN"],
    DA["DA_SEGMENT_KEYS"],
)


@dataclass
class DecodePlan:
    items: (
        np.ndarray
    )  # int32[W, 5]  token, sequence, split, splits of the row, partial slot (-1: row not split)
    rows: np.ndarray  # int32[R, 4]  rows that split: token, sequence, first partial slot, splits
    num_slots: int  # partial slots (sum of the splits of the rows that split)
    group_tile: int  # query heads per CTA (a kernel instantiation)
    lanes: int  # threads per key row (a kernel instantiation)
    head_chunks: int  # CTAs per KV head and split: ceil(group / group_tile)
    table_capacity: int  # block-table entries one segment of a split spans at most
    shared_mem: int  # dynamic shared memory bytes per CTA


def group_tile(dtype: str, group: int) -> int:
    """The instantiation (query heads per CTA) for a GQA group: the smallest that holds it, else the
    largest."""
    return next((g for g in GROUP_TILES[dtype] if g >= group), GROUP_TILES[dtype][-1])


def key_lanes(head_dim: int, itemsize: int) -> int:
    """Threads per key row: the next power of two >= its 16-byte chunks, at most 32 (as the kernel
    computes)."""
    chunks = head_dim * itemsize // 16
    return min(32, 1 << max(0, chunks - 1).bit_length())


def supports(
    dtype: str,
    itemsize: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
) -> bool:
    """Whether decode_attention.cu handles this shape: key rows of whole 16-byte chunks (cp.async), head_dim
    up to 256, an instantiated number of lanes per key row (8 to 32: bf16 head_dim >= 64, float32 >= 32)
    and at least as many as query heads per CTA (the score reduction hands one head to each group of lanes),
    block sizes that are powers of two (found by a shift) and cache rows that a 32-bit index reaches. Other
    shapes use paged_attention.cu."""
    lanes = key_lanes(head_dim, itemsize)
    return (
        head_dim * itemsize % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and lanes in LANES
        and lanes >= group_tile(dtype, num_q_heads // num_kv_heads)
        and block_size > 0
        and block_size & (block_size - 1) == 0
        and num_blocks * num_kv_heads * block_size < 2**31
    )


def split_length(context_lens, splits):
    """Keys per split of rows of `context_lens` keys cut into `splits` (either may be an array), as the
    kernels compute it (decode_attention.cu's split_length): whole tiles, at least MIN_SPLIT_KEYS. A row uses
    ceil(len / split_length) of its splits."""
    even = -(-np.asarray(context_lens, np.int64) // splits)
    return np.maximum(MIN_SPLIT_KEYS, -(-even // SPLIT_ALIGN) * SPLIT_ALIGN)


def choose_split_keys(context_lens: np.ndarray, ctas_per_split: int, multiprocessors: int) -> int:
    """Keys per split so that sum over rows of ceil(len / split) * ctas_per_split is about WAVES waves (a
    little under rather than just over, which would add a nearly empty wave)."""
    target_ctas = WAVES * multiprocessors * CTAS_PER_MULTIPROCESSOR
    keys = -(-int(context_lens.sum()) * ctas_per_split // max(1, target_ctas))
    return max(MIN_SPLIT_KEYS, -(-keys // SPLIT_ALIGN) * SPLIT_ALIGN)


def bucket_splits(num_rows: int, ctas_per_split: int, multiprocessors: int, max_context_len: int) -> int:
    """Splits per row of a graph bucket: about WAVES waves over its rows if each used all of them (a little
    under rather than over), and none that a row of max_context_len keys would leave empty."""
    target_ctas = WAVES * multiprocessors * CTAS_PER_MULTIPROCESSOR
    return max(1, min(target_ctas // (num_rows * ctas_per_split), -(-max_context_len // MIN_SPLIT_KEYS)))


def plan(
    tokens: np.ndarray,
    seqs: np.ndarray,
    context_lens: np.ndarray,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    itemsize: int,
    block_size: int,
    multiprocessors: int,
) -> DecodePlan:
    """A step's plan. tokens, seqs, context_lens: int[N] of the decode rows (query row, its sequence, keys it
    attends to)."""
    lens = np.asarray(context_lens, np.int64)  # int64[N]
    target = choose_split_keys(lens, _ctas_per_split(dtype, num_q_heads, num_kv_heads), multiprocessors)
    per_split = split_length(lens, -(-lens // target))  # even splits, whole tiles
    # As many splits as the row fills: the kernel's split length for that count is per_split again.
    return _plan(
        tokens,
        seqs,
        -(-lens // per_split),
        int(per_split.max(initial=1)),
        num_q_heads,
        num_kv_heads,
        head_dim,
        dtype,
        itemsize,
        block_size,
    )


def bucket_plan(
    tokens: np.ndarray,
    seqs: np.ndarray,
    max_context_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    itemsize: int,
    block_size: int,
    multiprocessors: int,
) -> DecodePlan:
    """A CUDA graph bucket's plan, for rows of 1 to max_context_len keys: the same splits in every row."""
    splits = bucket_splits(
        len(seqs), _ctas_per_split(dtype, num_q_heads, num_kv_heads), multiprocessors, max_context_len
    )
    return _plan(
        tokens,
        seqs,
        np.full(len(seqs), splits),
        int(split_length(max_context_len, splits)),
        num_q_heads,
        num_kv_heads,
        head_dim,
        dtype,
        itemsize,
        block_size,
    )


def _ctas_per_split(dtype: str, num_q_heads: int, num_kv_heads: int) -> int:
    group = num_q_heads // num_kv_heads
    return num_kv_heads * -(-group // group_tile(dtype, group))


def _plan(
    tokens,
    seqs,
    splits: np.ndarray,
    longest_split: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    itemsize: int,
    block_size: int,
) -> DecodePlan:
    """The work items and reduce rows for `splits` (int[N]) per row, whose splits hold at most longest_split
    keys."""
    group = num_q_heads // num_kv_heads
    tile = group_tile(dtype, group)
    splits = np.asarray(splits, np.int64)
    row_of_item = np.repeat(np.arange(len(splits)), splits)  # int64[W]
    index_in_row = np.arange(len(row_of_item)) - np.repeat(np.cumsum(splits) - splits, splits)
    split_rows = splits > 1
    first_slot = np.cumsum(np.where(split_rows, splits, 0)) - np.where(split_rows, splits, 0)  # int64[N]
    slot = np.where(split_rows[row_of_item], first_slot[row_of_item] + index_in_row, -1)
    tokens, seqs = np.asarray(tokens), np.asarray(seqs)
    items = (
        np.stack([tokens[row_of_item], seqs[row_of_item], index_in_row, splits[row_of_item], slot], axis=1)
        .astype(np.int32)
        .reshape(-1, 5)
    )
    rows = (
        np.stack([tokens[split_rows], seqs[split_rows], first_slot[split_rows], splits[split_rows]], axis=1)
        .astype(np.int32)
        .reshape(-1, 4)
    )
    segment = min(longest_split, SEGMENT_KEYS)
    table_capacity = -(-(segment - 1) // block_size) + 1  # blocks that `segment` keys span at any offset
    keys = tile_keys(itemsize)
    shared_mem = STAGES * 2 * keys * head_dim * itemsize + 4 * tile * keys + 2 * 4 * tile + 4 * table_capacity
    return DecodePlan(
        items,
        rows,
        int(np.where(split_rows, splits, 0).sum()),
        tile,
        key_lanes(head_dim, itemsize),
        -(-group // tile),
        table_capacity,
        shared_mem,
    )
