"""Batches built by hand and the checks on them, for tests and benchmark scripts that drive the model without
the engine; float32's fused multiply-add in NumPy, for tests that emulate native kernels bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minisarathi.batch import Batch, make_batch


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: `token_ids` at positions start_pos.. over its block table."""

    token_ids: list[int]
    start_pos: int  # tokens of this sequence already in the cache
    block_table: list[int]  # must cover start_pos + len(token_ids) tokens
    sample: bool  # whether this chunk ends where a token is sampled


def build_batch(chunks: list[ScheduledChunk], block_size: int) -> Batch:
    width = max((len(c.block_table) for c in chunks), default=0)
    block_tables = np.zeros((len(chunks), max(width, 1)), dtype=np.int32)
    for s, c in enumerate(chunks):
        block_tables[s, : len(c.block_table)] = c.block_table
    return make_batch(
        [t for c in chunks for t in c.token_ids],
        [c.start_pos for c in chunks],
        [len(c.token_ids) for c in chunks],
        block_tables,
        [c.sample for c in chunks],
        block_size,
    )


def scattered_batch(
    rng: np.random.Generator, runs: list[tuple[int, int]], block_size: int
) -> tuple[Batch, int]:
    """A batch of runs (tokens already cached, new tokens) per sequence whose blocks are scattered over a
    shuffled pool with a few spare blocks nobody uses; returns it and the pool's number of blocks."""
    needs = [-(-(start + n) // block_size) for start, n in runs]
    pool = rng.permutation(sum(needs) + 3)
    chunks, used = [], 0
    for (start, n), need in zip(runs, needs):
        chunks.append(ScheduledChunk(list(range(n)), start, [int(b) for b in pool[used : used + need]], True))
        used += need
    return build_batch(chunks, block_size), len(pool)


def forward_rows(model, cache, chunk: ScheduledChunk, block_size: int) -> np.ndarray:
    """Logits of every token of one sequence's chunk (the engine only asks for the last)."""
    batch = build_batch([chunk], block_size)
    batch.logits_indices = np.arange(batch.num_tokens, dtype=np.int32)
    return model.forward(batch, cache)


def prefill_then_greedy(model, prompt, new_tokens, block_size=16, chunk_size=None):
    """(logits float32[P, V] of the prompt, greedy tokens) for one sequence in contiguous blocks."""
    chunk_size = chunk_size or len(prompt)
    table = list(range(-(-(len(prompt) + new_tokens) // block_size)))
    cache = model.new_kv_cache(len(table), block_size)
    logits = np.concatenate(
        [
            forward_rows(model, cache, ScheduledChunk(prompt[i : i + chunk_size], i, table, True), block_size)
            for i in range(0, len(prompt), chunk_size)
        ]
    )
    ids = list(prompt) + [int(logits[-1].argmax())]
    while len(ids) < len(prompt) + new_tokens:
        step = model.forward(
            build_batch([ScheduledChunk(ids[-1:], len(ids) - 1, table, True)], block_size), cache
        )
        ids.append(int(step[0].argmax()))
    return logits, ids[len(prompt) :]


def relative_error(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once, as a fused multiply-add: the product is exact in float64, the sum's
    error is recovered exactly (TwoSum) and folded in by rounding to odd, so rounding to float32 after is
    the single rounding of the exact value."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c = np.asarray(c, np.float64)
    s = p + c
    t = s - p
    err = (p - (s - t)) + (c - t)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)
