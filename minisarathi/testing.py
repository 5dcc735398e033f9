"""Batches built by hand, for tests and benchmark scripts that drive the model without the engine."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minisarathi.batch import Batch, make_batch


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: `token_ids` at positions start_pos.. over its block table."""
    token_ids: list[int]
    start_pos: int              # tokens of this sequence already in the cache
    block_table: list[int]      # must cover start_pos + len(token_ids) tokens
    sample: bool                # whether this chunk ends where a token is sampled


def build_batch(chunks: list[ScheduledChunk], block_size: int) -> Batch:
    width = max((len(c.block_table) for c in chunks), default=0)
    block_tables = np.zeros((len(chunks), max(width, 1)), dtype=np.int32)
    for s, c in enumerate(chunks):
        block_tables[s, :len(c.block_table)] = c.block_table
    return make_batch([t for c in chunks for t in c.token_ids], [c.start_pos for c in chunks],
                      [len(c.token_ids) for c in chunks], block_tables, [c.sample for c in chunks], block_size)
