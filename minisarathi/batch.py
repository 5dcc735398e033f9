"""The batch contract: the flat arrays one forward call runs on (the rules are in docs/architecture.md).

Block-table entries past a sequence's last block are 0. A backend may read them (the NumPy decode attention
pads every row to the longest context and masks the padding's scores) but must never let them change a result.
A negative slot in slot_mapping marks a padding token whose K/V is not stored (both backends skip it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    input_ids: np.ndarray  # int32[T]    token ids, sequence after sequence
    positions: np.ndarray  # int32[T]    absolute position of each token in its sequence
    slot_mapping: np.ndarray  # int32[T]    KV slot of each token: block_id * block_size + offset
    query_start: np.ndarray  # int32[S+1]  tokens of sequence s are rows query_start[s] .. query_start[s+1]-1
    context_lens: np.ndarray  # int32[S]    tokens of sequence s in the cache once this step's K/V is written
    block_tables: np.ndarray  # int32[S, B] KV blocks of sequence s in order, zero-padded (see below)
    logits_indices: np.ndarray  # int32[N]    rows of T whose logits are wanted, sorted
    max_query_len: int
    max_context_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def make_batch(
    token_ids: list[int],
    start_pos: list[int],
    num_tokens: list[int],
    block_tables: np.ndarray,
    sample: list[bool],
    block_size: int,
) -> Batch:
    """The batch of one step: sequence s runs num_tokens[s] of `token_ids` (all sequences' tokens back to
    back) from start_pos[s] over block_tables[s] (int32[S, B], zero-padded); it samples when sample[s]."""
    q_lens = np.array(num_tokens, np.int32)  # int32[S]
    starts = np.array(start_pos, np.int32)  # int32[S]
    context_lens = starts + q_lens
    input_ids = np.array(token_ids, np.int32)  # int32[T]
    num_seqs, max_query_len = len(q_lens), int(q_lens.max(initial=0))
    if max_query_len == 1 and len(input_ids) == num_seqs:  # one token per sequence (decodes)
        query_start = np.arange(num_seqs + 1, dtype=np.int32)
        seq_of_token, positions = np.arange(num_seqs), starts
    else:
        query_start = np.zeros(num_seqs + 1, np.int32)  # int32[S+1]
        np.cumsum(q_lens, out=query_start[1:])
        # positions[i] = start_pos of i's sequence + i's offset within its run
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(len(input_ids), dtype=np.int32) + (starts - query_start[:-1])[seq_of_token]
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    logits_indices = query_start[1:][np.array(sample, bool)] - 1
    return Batch(
        input_ids,
        positions,
        slot_mapping.astype(np.int32),
        query_start,
        context_lens,
        block_tables,
        logits_indices.astype(np.int32),
        max_query_len,
        max_context_len=int(context_lens.max(initial=0)),
    )
