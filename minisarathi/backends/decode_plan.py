"""The host side of cuda/decode_attention.cu: which CTAs to launch for the decode rows of a batch.

Flash-decoding splits each row's keys so that the grid fills the GPU. The split length is chosen once per
batch, before the launch, from the total work: enough CTAs for about WAVES waves on the device's
multiprocessors, but no split shorter than MIN_SPLIT_KEYS (below that the merge costs more than the
parallelism gains) or longer than MAX_SPLIT_KEYS (which bounds the block-table entries a CTA stages).
Each row's keys are then divided evenly among its splits. Only rows with several splits own partial slots,
so the partial buffers are sized by the rows that split, and no CTA reads or writes past its row's end.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minisarathi.backends.kernel_source import kernel_constants

DA = kernel_constants("decode_attention.cu")
THREADS, STAGES = DA["DA_THREADS"], DA["DA_STAGES"]
MAX_HEAD_DIM = 32 * DA["DA_LANE_ELEMENTS"]      # 32 lanes own a key row
GROUP_TILES = {"float32": (4,), "float16": (4, 8), "bfloat16": (4, 8)}   # instantiated query heads per CTA
LANES = (8, 16, 32)                             # instantiated threads per key row
# Every instantiation (dtype, query heads per CTA, lanes per key row) of decode_attention_kernel.
INSTANTIATIONS = [(dtype, tile, lanes) for dtype, tiles in GROUP_TILES.items() for tile in tiles for lanes in LANES]


def tile_keys(itemsize: int) -> int:
    return DA["DA_TILE_KEYS_FLOAT"] if itemsize == 4 else DA["DA_TILE_KEYS_16BIT"]


WAVES = 2
CTAS_PER_MULTIPROCESSOR = 4    # resident decode CTAs per SM at head_dim 128 (registers and shared memory; docs/performance.md)
MIN_SPLIT_KEYS = 64
MAX_SPLIT_KEYS = 2048
SPLIT_ALIGN = 32               # split lengths are whole tiles


@dataclass
class DecodePlan:
    items: np.ndarray       # int32[W, 5]  token, sequence, key_begin, key_end, partial slot (-1: row not split)
    rows: np.ndarray        # int32[R, 3]  rows that split: token, first partial slot, splits
    num_slots: int          # partial slots (sum of the splits of the rows that split)
    split_keys: int         # the batch's target split length
    group_tile: int         # query heads per CTA (a kernel instantiation)
    lanes: int              # threads per key row (a kernel instantiation)
    head_chunks: int        # CTAs per KV head and split: ceil(group / group_tile)
    table_capacity: int     # block-table entries one split spans at most
    shared_mem: int         # dynamic shared memory bytes per CTA


def group_tile(dtype: str, group: int) -> int:
    """The instantiation (query heads per CTA) for a GQA group: the smallest that holds it, else the largest."""
    return next((g for g in GROUP_TILES[dtype] if g >= group), GROUP_TILES[dtype][-1])


def key_lanes(head_dim: int, itemsize: int) -> int:
    """Threads per key row: the next power of two >= its 16-byte chunks, at most 32 (as the kernel computes)."""
    chunks = head_dim * itemsize // 16
    return min(32, 1 << max(0, chunks - 1).bit_length())


def supports(dtype: str, itemsize: int, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
             num_blocks: int) -> bool:
    """Whether decode_attention.cu handles this shape: key rows of whole 16-byte chunks (cp.async), head_dim
    up to 256, an instantiated number of lanes per key row (8 to 32: bf16 head_dim >= 64, float32 >= 32)
    and at least as many as query heads per CTA (the score reduction hands one head to each group of lanes),
    block sizes that are powers of two (found by a shift) and cache rows that a 32-bit index reaches. Other
    shapes use paged_attention.cu."""
    lanes = key_lanes(head_dim, itemsize)
    return (head_dim * itemsize % 16 == 0 and head_dim <= MAX_HEAD_DIM
            and lanes in LANES and lanes >= group_tile(dtype, num_q_heads // num_kv_heads)
            and block_size > 0 and block_size & (block_size - 1) == 0
            and num_blocks * num_kv_heads * block_size < 2 ** 31)


def choose_split_keys(context_lens: np.ndarray, ctas_per_split: int, multiprocessors: int) -> int:
    """Keys per split so that sum over rows of ceil(len / split) * ctas_per_split is about WAVES waves (a
    little under rather than just over, which would add a nearly empty wave)."""
    target_ctas = WAVES * multiprocessors * CTAS_PER_MULTIPROCESSOR
    keys = -(-int(context_lens.sum()) * ctas_per_split // max(1, target_ctas))
    keys = -(-keys // SPLIT_ALIGN) * SPLIT_ALIGN
    return min(MAX_SPLIT_KEYS, max(MIN_SPLIT_KEYS, keys))


def plan(tokens: np.ndarray, seqs: np.ndarray, context_lens: np.ndarray, num_q_heads: int, num_kv_heads: int,
         head_dim: int, dtype: str, itemsize: int, block_size: int, multiprocessors: int) -> DecodePlan:
    """tokens, seqs, context_lens: int[N] of the decode rows (query row, its sequence, keys it attends to)."""
    group = num_q_heads // num_kv_heads
    tile = group_tile(dtype, group)
    head_chunks = -(-group // tile)
    split_keys = choose_split_keys(context_lens, num_kv_heads * head_chunks, multiprocessors)
    lens = np.asarray(context_lens, np.int64)                                   # int64[N]
    splits = np.maximum(1, -(-lens // split_keys))                               # int64[N]
    # Even splits of each row, in whole tiles where the row allows it.
    even = -(-lens // splits)
    per_split = np.minimum(lens, -(-even // SPLIT_ALIGN) * SPLIT_ALIGN)         # int64[N]
    splits = -(-lens // per_split)
    row_of_item = np.repeat(np.arange(len(lens)), splits)                       # int64[W]
    index_in_row = np.arange(len(row_of_item)) - np.repeat(np.cumsum(splits) - splits, splits)
    key_begin = index_in_row * per_split[row_of_item]
    key_end = np.minimum(key_begin + per_split[row_of_item], lens[row_of_item])
    split_rows = splits > 1
    first_slot = np.cumsum(np.where(split_rows, splits, 0)) - np.where(split_rows, splits, 0)   # int64[N]
    slot = np.where(split_rows[row_of_item], first_slot[row_of_item] + index_in_row, -1)
    items = np.stack([np.asarray(tokens)[row_of_item], np.asarray(seqs)[row_of_item], key_begin, key_end, slot],
                     axis=1).astype(np.int32)
    rows = np.stack([np.asarray(tokens)[split_rows], first_slot[split_rows], splits[split_rows]],
                    axis=1).astype(np.int32).reshape(-1, 3)
    shift = int(block_size).bit_length() - 1
    table_capacity = int((((key_end - 1) >> shift) - (key_begin >> shift)).max(initial=0)) + 1
    keys = tile_keys(itemsize)
    shared_mem = STAGES * 2 * keys * head_dim * itemsize + 4 * tile * keys + 2 * 4 * tile + 4 * table_capacity
    return DecodePlan(items, rows, int(np.where(split_rows, splits, 0).sum()), split_keys, tile,
                      key_lanes(head_dim, itemsize), head_chunks, table_capacity, shared_mem)
