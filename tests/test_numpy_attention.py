"""The NumPy backend's paged attention: decode groups, per-batch plans and kept decode K/V change nothing but
speed; kept decode K/V's memory is made with the cache, not in a step, and is resident only ahead of need.
(Exactness against a float64 dense reference: tests/test_model.py::test_paged_attention_matches_dense_float64.)"""
import dataclasses
import os
import sys

import numpy as np
import pytest

from minisarathi.backends import numpy_attention
from minisarathi.backends.numpy_ops import NumpyOps
from minisarathi.testing import ScheduledChunk, build_batch

Hq, Hk, D, BLOCK_SIZE = 8, 2, 16, 4


def case(seed: int, runs):
    """A batch of (history, new tokens) runs over blocks scattered in a pool, its caches and queries."""
    rng = np.random.default_rng(seed)
    needs = [-(-(h + n) // BLOCK_SIZE) for h, n in runs]
    pool = rng.permutation(sum(needs) + 3).tolist()
    batch = build_batch([ScheduledChunk([0] * n, h, [pool.pop() for _ in range(need)], True)
                         for (h, n), need in zip(runs, needs)], BLOCK_SIZE)
    shape = (sum(needs) + 3, Hk, BLOCK_SIZE, D)
    k_cache, v_cache = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((batch.num_tokens, Hq, D)).astype(np.float32)
    return batch, q, k_cache, v_cache


DECODES_FIRST = [(9, 1), (30, 1), (0, 1), (17, 1), (3, 1), (12, 6), (0, 9)]
DECODES_BETWEEN = [(12, 6), (9, 1), (30, 1), (0, 9), (17, 1), (3, 1)]


@pytest.mark.parametrize("runs", [DECODES_FIRST, DECODES_BETWEEN])
@pytest.mark.parametrize("group_bytes", [1, 2 * Hk * 32 * D * 4 * 2, 1 << 30])   # 1 sequence, 2, all
def test_decode_groups_give_the_same_output(monkeypatch, runs, group_bytes):
    """Decodes gathered group by group each step (the path when their K/V is not kept across steps)."""
    batch, q, k_cache, v_cache = case(1, runs)
    whole = NumpyOps().paged_attention(q, k_cache, v_cache, batch, 0.25)
    monkeypatch.setattr(numpy_attention, "DECODE_GROUP_BYTES", group_bytes)
    plan = numpy_attention.AttentionPlan(batch, *k_cache.shape)
    grouped = numpy_attention.paged_attention(q, k_cache, v_cache, plan, numpy_attention.GatherBuffers(), 0.25)
    np.testing.assert_array_equal(grouped, whole)


def test_a_plan_serves_only_its_batch():
    """One backend over batches that follow each other (as engine steps do), against a fresh one for each."""
    ops = NumpyOps()
    for seed, runs in enumerate([DECODES_FIRST, DECODES_BETWEEN, DECODES_FIRST[:3], [(40, 1), (5, 1)]]):
        batch, q, k_cache, v_cache = case(seed, runs)
        for step_batch in (batch, dataclasses.replace(batch, context_lens=batch.context_lens.copy())):
            got = ops.paged_attention(q, k_cache, v_cache, step_batch, 0.3)
            np.testing.assert_array_equal(got, NumpyOps().paged_attention(q, k_cache, v_cache, step_batch, 0.3))
        # the same batch object with an array replaced is another batch: shorter decode contexts here
        shorter = batch.context_lens - (np.diff(batch.query_start) == 1) * (batch.context_lens > 1)
        before = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
        batch.context_lens = shorter
        after = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
        np.testing.assert_array_equal(after, NumpyOps().paged_attention(q, k_cache, v_cache, batch, 0.3))
        assert not np.array_equal(after, before)


def born_full_of_nan(shape, dtype=float, order="C"):
    """np.empty as it may be: float buffers that hold NaN until written."""
    return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -7, dtype, order=order)


def test_kept_decode_kv_follows_every_write_and_batch_change(monkeypatch):
    """Engine-like steps with one backend: decodes write their token (store_kv) then attend; sequences
    finish and new ones take their freed blocks (written anew through store_kv); copy_blocks overwrites a
    block. Each step's output must equal a fresh backend's, which copies everything, and the path that
    gathers every step."""
    monkeypatch.setattr(numpy_attention, "DECODE_GROUP_BYTES", 1)   # keep even this small decode K/V
    monkeypatch.setattr(np, "empty", born_full_of_nan)   # whatever is read of a buffer (padding too) was written
    kept_steps = 0
    rng = np.random.default_rng(7)
    num_blocks = 48
    k_cache, v_cache = (rng.standard_normal((num_blocks, Hk, BLOCK_SIZE, D)).astype(np.float32) for _ in range(2))
    free = list(rng.permutation(num_blocks))
    seqs = []      # [length in the cache, blocks]

    def admit(length):
        blocks = [free.pop() for _ in range(-(-(length + 15) // BLOCK_SIZE))]   # room for 15 decodes
        prompt = build_batch([ScheduledChunk([0] * length, 0, blocks, True)], BLOCK_SIZE)
        kv = rng.standard_normal((length, Hk, D)).astype(np.float32)
        ops.store_kv(kv, -kv, k_cache, v_cache, prompt.slot_mapping)
        seqs.append([length, blocks])

    ops = NumpyOps()
    for length in (5, 13, 2, 9):
        admit(length)
    for step in range(14):
        if step in (4, 9):                 # the second sequence finishes; a new one reuses its blocks
            _, blocks = seqs.pop(1)
            free.extend(blocks[::-1])
            admit(int(rng.integers(1, 12)))
        if step in (6, 11):                # copy-on-write: a block of the first sequence is overwritten
            ops.copy_blocks([(k_cache, v_cache)], [seqs[-1][1][0]], [seqs[0][1][0]])
        batch = build_batch([ScheduledChunk([0], n, blocks, True) for n, blocks in seqs], BLOCK_SIZE)
        kv = rng.standard_normal((len(seqs), Hk, D)).astype(np.float32)
        ops.store_kv(kv, kv * 2, k_cache, v_cache, batch.slot_mapping)
        q = rng.standard_normal((len(seqs), Hq, D)).astype(np.float32)
        kept_steps += numpy_attention.AttentionPlan(batch, *k_cache.shape).keeps_decode_kv
        got = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
        np.testing.assert_array_equal(got, NumpyOps().paged_attention(q, k_cache, v_cache, batch, 0.3))
        plan = numpy_attention.AttentionPlan(batch, *k_cache.shape)
        gathered = numpy_attention.paged_attention(q, k_cache, v_cache, plan, numpy_attention.GatherBuffers(), 0.3)
        np.testing.assert_array_equal(got, gathered)
        for s in seqs:
            s[0] += 1
    assert kept_steps == 14


class RecordedKeptMemory(numpy_attention.KeptMemory):
    made: list = []

    def __init__(self, size):
        super().__init__(size)
        self.made.append(self)


def test_kept_decode_kv_lives_in_memory_made_with_the_cache(monkeypatch):
    """The memory decode K/V is kept in is made by NumpyOps.zeros with each cache, not in a step: engine-like
    steps in which the decode K/V grows past half of DECODE_GROUP_BYTES (its memory written ahead), then past
    it (kept), its longest context enters new blocks (kept K/V laid out anew) and sequences join, against the
    path that gathers every step; the kept K/V handed to the products lies in the memory made with the caches."""
    tile_bytes = 2 * Hk * BLOCK_SIZE * D * 4             # K and V of one block
    monkeypatch.setattr(numpy_attention, "DECODE_GROUP_BYTES", 10 * tile_bytes)   # kept from 11 blocks on
    monkeypatch.setattr(numpy_attention, "WRITE_AHEAD_BYTES", 2 * tile_bytes)
    monkeypatch.setattr(numpy_attention, "KeptMemory", RecordedKeptMemory)
    made = RecordedKeptMemory.made = []
    ops = NumpyOps()
    num_blocks = 40
    k_cache, v_cache = ops.zeros((num_blocks, Hk, BLOCK_SIZE, D)), ops.zeros((num_blocks, Hk, BLOCK_SIZE, D))
    assert [m.array.size for m in made] == [k_cache.size, v_cache.size]
    assert all(not m.array.any() for m in made)      # zeros: padding read from it is finite
    made_with_the_caches = len(made)
    kept_views = []
    gather = numpy_attention.DecodeKV.gather
    monkeypatch.setattr(numpy_attention.DecodeKV, "gather", lambda *a: kept_views.append(gather(*a)) or kept_views[-1])

    rng = np.random.default_rng(3)
    free = list(rng.permutation(num_blocks))
    seqs = []      # [length in the cache, blocks]

    def admit(length):
        blocks = [free.pop() for _ in range(-(-(length + 12) // BLOCK_SIZE))]   # room for 12 decodes
        prompt = build_batch([ScheduledChunk([0] * length, 0, blocks, True)], BLOCK_SIZE)
        kv = rng.standard_normal((length, Hk, D)).astype(np.float32)
        ops.store_kv(kv, kv - 1, k_cache, v_cache, prompt.slot_mapping)
        seqs.append([length, blocks])

    for length in (3, 6):
        admit(length)
    steps = []      # (nears keeping, keeps, B)
    for step in range(12):
        if step in (2, 3, 7):      # decodes join, one by one and between kept steps
            admit(int(rng.integers(2, 9)))
        batch = build_batch([ScheduledChunk([0], n, blocks, True) for n, blocks in seqs], BLOCK_SIZE)
        kv = rng.standard_normal((len(seqs), Hk, D)).astype(np.float32)
        ops.store_kv(kv, kv * 3, k_cache, v_cache, batch.slot_mapping)
        q = rng.standard_normal((len(seqs), Hq, D)).astype(np.float32)
        plan = numpy_attention.AttentionPlan(batch, *k_cache.shape)
        steps.append((plan.nears_keeping_decode_kv, plan.keeps_decode_kv, plan.decode_blocks.shape[1]))
        got = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
        gathered = numpy_attention.paged_attention(q, k_cache, v_cache, plan, numpy_attention.GatherBuffers(), 0.3)
        np.testing.assert_array_equal(got, gathered)
        for s in seqs:
            s[0] += 1
    assert len(made) == made_with_the_caches      # none made in a step
    kept_widths = {width for _, kept, width in steps if kept}
    assert not steps[0][1] and steps[-1][1] and len(kept_widths) >= 2   # switched on; laid out anew since
    first_kept = [kept for _, kept, _ in steps].index(True)
    assert any(nears for nears, _, _ in steps[:first_kept])            # written ahead before the switch
    assert len(kept_views) == sum(kept for _, kept, _ in steps)
    for views in kept_views:
        for view, memory in zip(views, made):
            assert np.shares_memory(view, memory.array)


def resident_bytes(array: np.ndarray) -> int:
    """How much of array's memory is resident (present in /proc/self/pagemap: bit 63 of each page's entry)."""
    page = os.sysconf("SC_PAGE_SIZE")
    address = array.__array_interface__["data"][0]
    first, last = address // page, (address + array.nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
    return int((entries >> np.uint64(63)).sum()) * page


def decode_batch(table: np.ndarray, num_decodes: int, blocks_per_seq: int):
    """num_decodes decodes whose contexts fill blocks_per_seq blocks of their rows of table."""
    return build_batch([ScheduledChunk([0], blocks_per_seq * BLOCK_SIZE - 1, table[s, :blocks_per_seq].tolist(), True)
                        for s in range(num_decodes)], BLOCK_SIZE)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")
def test_kept_memory_is_resident_only_ahead_of_need(monkeypatch):
    """Nothing of the kept memory is resident at start-up (nor made, where the cache can never keep decode
    K/V); as a step's decode K/V passes half of DECODE_GROUP_BYTES, each attention call writes
    WRITE_AHEAD_BYTES more of its prefix, all of it before the step that starts keeping, no more; once
    DecodeKV holds the memory, nothing is written ahead into it (its K/V would be zeroed). Memory under 2 MiB:
    4 KiB pages, no huge page."""
    tile_bytes = 2 * Hk * BLOCK_SIZE * D * 4                                  # K and V of one block: 1 KiB
    group_bytes, ahead_bytes = 256 * tile_bytes, 32 * tile_bytes
    monkeypatch.setattr(numpy_attention, "DECODE_GROUP_BYTES", group_bytes)  # kept from 257 blocks on
    monkeypatch.setattr(numpy_attention, "WRITE_AHEAD_BYTES", ahead_bytes)
    monkeypatch.setattr(numpy_attention, "KeptMemory", RecordedKeptMemory)
    made = RecordedKeptMemory.made = []
    ops = NumpyOps()
    ops.zeros((group_bytes // tile_bytes, Hk, BLOCK_SIZE, D))   # K and V of all its blocks: the group
    assert made == []                                           # it can never keep decode K/V
    num_blocks = 1024
    rng = np.random.default_rng(5)
    k_cache, v_cache = ops.zeros((num_blocks, Hk, BLOCK_SIZE, D)), ops.zeros((num_blocks, Hk, BLOCK_SIZE, D))
    k_cache[:], v_cache[:] = (rng.standard_normal(k_cache.shape).astype(np.float32) for _ in range(2))
    assert [resident_bytes(m.array) for m in made] == [0, 0]
    table = rng.permutation(num_blocks).reshape(32, 32)

    def step(num_decodes, blocks_per_seq):
        batch = decode_batch(table, num_decodes, blocks_per_seq)
        q = rng.standard_normal((num_decodes, Hq, D)).astype(np.float32)
        plan = numpy_attention.AttentionPlan(batch, *k_cache.shape)
        got = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
        gathered = numpy_attention.paged_attention(q, k_cache, v_cache, plan, numpy_attention.GatherBuffers(), 0.3)
        np.testing.assert_array_equal(got, gathered)
        return plan, [resident_bytes(m.array) for m in made]

    for blocks_per_seq in range(2, 5):       # 64-128 blocks of K/V: under half the group
        _, resident = step(32, blocks_per_seq)
        assert resident == [0, 0]
    prefix = group_bytes // 2                # of K, and of V: what a switch from 256 blocks copies
    ahead = 0
    for blocks_per_seq in range(5, 9):       # 160-256 blocks: written ahead, a slice a call, 4 calls
        plan, resident = step(32, blocks_per_seq)
        assert plan.nears_keeping_decode_kv and not plan.keeps_decode_kv
        ahead = min(ahead + ahead_bytes, prefix)
        assert resident == [ahead, ahead]
    assert ahead == prefix                   # the prefix written before the switch
    plan, resident = step(32, 9)             # 288 blocks, 144 KiB of K and of V: kept, 16 KiB past the prefix
    assert plan.keeps_decode_kv and resident == [288 * tile_bytes // 2] * 2

    # a decode K/V that passes the group in one step, nothing written ahead: the kept K/V faulted in as copied;
    # then near keeping again (not kept): the memory, DecodeKV's now, is not written ahead
    ops = NumpyOps()
    k_cache, v_cache = ops.zeros(k_cache.shape), ops.zeros(k_cache.shape)
    k_cache[:], v_cache[:] = (rng.standard_normal(k_cache.shape).astype(np.float32) for _ in range(2))
    kept_bytes = 32 * 12 * tile_bytes // 2   # 384 blocks of K (or V): 192 KiB
    plan, resident = step(32, 12)
    assert plan.keeps_decode_kv and resident[2:] == [kept_bytes, kept_bytes]
    plan, resident = step(16, 12)            # 192 blocks
    assert plan.nears_keeping_decode_kv and resident[2:] == [kept_bytes, kept_bytes]
    step(32, 12)                             # the same B and blocks: read from the memory, not copied again
