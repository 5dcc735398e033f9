"""The batch contract: the flat arrays one forward call runs on (see docs/architecture.md)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    input_ids: np.ndarray       # int32[T]    token ids, sequence after sequence
    positions: np.ndarray       # int32[T]    absolute position of each token in its sequence
    slot_mapping: np.ndarray    # int32[T]    KV slot of each token: block_id * block_size + offset
    query_start: np.ndarray     # int32[S+1]  tokens of sequence s are rows query_start[s] .. query_start[s+1]-1
    context_lens: np.ndarray    # int32[S]    tokens of sequence s in the cache once this step's K/V is written
    block_tables: np.ndarray    # int32[S, B] KV blocks of sequence s in order; unused entries 0, never read
    logits_indices: np.ndarray  # int32[N]    rows of T whose logits are wanted, sorted
    max_query_len: int
    max_context_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: `token_ids` at positions start_pos.. over its block table."""
    token_ids: list[int]
    start_pos: int              # tokens of this sequence already in the cache
    block_table: list[int]      # must cover start_pos + len(token_ids) tokens
    sample: bool                # whether this chunk ends where a token is sampled


def build_batch(chunks: list[ScheduledChunk], block_size: int) -> Batch:
    q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int32)
    query_start = np.zeros(len(chunks) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=query_start[1:])
    context_lens = np.array([c.start_pos + len(c.token_ids) for c in chunks], dtype=np.int32)
    width = max((len(c.block_table) for c in chunks), default=0)
    block_tables = np.zeros((len(chunks), max(width, 1)), dtype=np.int32)
    for s, c in enumerate(chunks):
        block_tables[s, :len(c.block_table)] = c.block_table
    input_ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int32, count=int(query_start[-1]))
    # positions[i] = start_pos of i's sequence + i's offset within its run
    seq_of_token = np.repeat(np.arange(len(chunks)), q_lens)
    starts = np.array([c.start_pos for c in chunks], dtype=np.int32)
    positions = (starts[seq_of_token] + np.arange(len(input_ids)) - query_start[seq_of_token]).astype(np.int32)
    slot_mapping = (block_tables[seq_of_token, positions // block_size] * block_size
                    + positions % block_size).astype(np.int32)
    logits_indices = np.array([query_start[s + 1] - 1 for s, c in enumerate(chunks) if c.sample], dtype=np.int32)
    return Batch(input_ids, positions, slot_mapping, query_start, context_lens, block_tables, logits_indices,
                 max_query_len=int(q_lens.max(initial=0)), max_context_len=int(context_lens.max(initial=0)))
