"""The CPU backend's paged attention on NumPy's decode path (where the native decode kernel does not run):
decode groups, per-batch plans and kept decode K/V change nothing but speed; kept decode K/V's memory is made
with the cache, not in a step. (Exactness against a float64 dense reference:
tests/unit/test_cpu_ops.py::test_paged_attention_matches_dense_float64; the native kernel:
tests/unit/test_native_attention.py.)"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends.cpu import attention, native_attention
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.testing import ScheduledChunk, build_batch

Hq, Hk, D, BLOCK_SIZE = 8, 2, 16, 4


@pytest.fixture(autouse=True)
def numpy_decodes(monkeypatch):
    """CpuOps' decodes on NumPy, as where the native kernel cannot run."""
    monkeypatch.setattr(native_attention, "runs", lambda: False)


def case(seed: int, runs):
    """A batch of (history, new tokens) runs over blocks scattered in a pool, its caches and queries."""
    rng = np.random.default_rng(seed)
    needs = [-(-(h + n) // BLOCK_SIZE) for h, n in runs]
    pool = rng.permutation(sum(needs) + 3).tolist()
    batch = build_batch(
        [
            ScheduledChunk([0] * n, h, [pool.pop() for _ in range(need)], True)
            for (h, n), need in zip(runs, needs)
        ],
        BLOCK_SIZE,
    )
    shape = (sum(needs) + 3, Hk, BLOCK_SIZE, D)
    k_cache, v_cache = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((batch.num_tokens, Hq, D)).astype(np.float32)
    return batch, q, k_cache, v_cache


DECODES_FIRST = [(9, 1), (30, 1), (0, 1), (17, 1), (3, 1), (12, 6), (0, 9)]
DECODES_BETWEEN = [(12, 6), (9, 1), (30, 1), (0, 9), (17, 1), (3, 1)]


@pytest.mark.parametrize("runs", [DECODES_FIRST, DECODES_BETWEEN])
@pytest.mark.parametrize("group_bytes", [1, 2 * Hk * 32 * D * 4 * 2, 1 << 30])  # 1 sequence, 2, all
def test_decode_groups_give_the_same_output(monkeypatch, runs, group_bytes):
    """Decodes gathered group by group each step (the path when their K/V is not kept across steps)."""
    batch, q, k_cache, v_cache = case(1, runs)
    whole = CpuOps().paged_attention(q, k_cache, v_cache, batch, 0.25)
    monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", group_bytes)
    plan = attention.AttentionPlan(batch, *k_cache.shape)
    grouped = attention.paged_attention(q, k_cache, v_cache, plan, attention.GatherBuffers(), 0.25)
    np.testing.assert_array_equal(grouped, whole)


def test_a_plan_serves_only_its_batch():
    """One backend over batches that follow each other (as engine steps do), against a fresh one for each."""
    ops = CpuOps()
    for seed, runs in enumerate([DECODES_FIRST, DECODES_BETWEEN, DECODES_FIRST[:3], [(40, 1), (5, 1)]]):
        batch, q, k_cache, v_cache = case(seed, runs)
        for step_batch in (batch, dataclasses.replace(batch, context_lens=batch.context_lens.copy())):
            got = ops.paged_attention(q, k_cache, v_cache, step_batch, 0.3)
            np.testing.assert_array_equal(got, CpuOps().paged_attention(q, k_cache, v_cache, step_batch, 0.3))
        # the same batch object with an array replaced is another batch: shorter decode contexts here
        shorter = batch.context_lens - (np.diff(batch.query_start) == 1) * (batch.context_lens > 1)
        before = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
        batch.context_lens = shorter
        after = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
        np.testing.assert_array_equal(after, CpuOps().paged_attention(q, k_cache, v_cache, batch, 0.3))
        assert not np.array_equal(after, before)


def born_full_of_nan(shape, dtype=float, order="C"):
    """np.empty as it may be: float buffers that hold NaN until written."""
    return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -7, dtype, order=order)


def test_kept_decode_kv_follows_every_write_and_batch_change(monkeypatch):
    """Engine-like steps with one backend: decodes write their token (store_kv) then attend; sequences
    finish and new ones take their freed blocks (written anew through store_kv); copy_blocks overwrites a
    block. Each step's output must equal a fresh backend's, which copies everything, and the path that
    gathers every step."""
    monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", 1)  # keep even this small decode K/V
    monkeypatch.setattr(
        np, "empty", born_full_of_nan
    )  # whatever is read of a buffer (padding too) was written
    kept_steps = 0
    rng = np.random.default_rng(7)
    num_blocks = 48
    k_cache, v_cache = (
        rng.standard_normal((num_blocks, Hk, BLOCK_SIZE, D)).astype(np.float32) for _ in range(2)
    )
    free = list(rng.permutation(num_blocks))
    seqs = []  # [length in the cache, blocks]

    def admit(length):
        blocks = [free.pop() for _ in range(-(-(length + 15) // BLOCK_SIZE))]  # room for 15 decodes
        prompt = build_batch([ScheduledChunk([0] * length, 0, blocks, True)], BLOCK_SIZE)
        kv = rng.standard_normal((length, Hk, D)).astype(np.float32)
        ops.store_kv(kv, -kv, k_cache, v_cache, prompt.slot_mapping)
        seqs.append([length, blocks])

    ops = CpuOps()
    for length in (5, 13, 2, 9):
        admit(length)
    for step in range(14):
        if step in (4, 9):  # the second sequence finishes; a new one reuses its blocks
            _, blocks = seqs.pop(1)
            free.extend(blocks[::-1])
            admit(int(rng.integers(1, 12)))
        if step in (6, 11):  # copy-on-write: a block of the first sequence is overwritten
            ops.copy_blocks([(k_cache, v_cache)], [seqs[-1][1][0]], [seqs[0][1][0]])
        batch = build_batch([ScheduledChunk([0], n, blocks, True) for n, blocks in seqs], BLOCK_SIZE)
        kv = rng.standard_normal((len(seqs), Hk, D)).astype(np.float32)
        ops.store_kv(kv, kv * 2, k_cache, v_cache, batch.slot_mapping)
        q = rng.standard_normal((len(seqs), Hq, D)).astype(np.float32)
        kept_steps += attention.AttentionPlan(batch, *k_cache.shape).keeps_decode_kv
        got = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
        np.testing.assert_array_equal(got, CpuOps().paged_attention(q, k_cache, v_cache, batch, 0.3))
        plan = attention.AttentionPlan(batch, *k_cache.shape)
        gathered = attention.paged_attention(q, k_cache, v_cache, plan, attention.GatherBuffers(), 0.3)
        np.testing.assert_array_equal(got, gathered)
        for s in seqs:
            s[0] += 1
    assert kept_steps == 14


def test_kept_decode_kv_lives_in_memory_made_with_the_cache(monkeypatch):
    """The memory decode K/V is kept in is made by CpuOps.zeros with each cache, not in a step: engine-like
    steps in which the decode K/V grows past DECODE_GROUP_BYTES (gathered each step, then kept), its longest
    context enters new blocks (kept K/V laid out anew) and sequences join, against the path that gathers every
    step; the kept K/V handed to the products lies in the memory made with the caches."""
    made = []
    monkeypatch.setattr(
        attention, "kept_memory", lambda size, make=attention.kept_memory: made.append(make(size)) or made[-1]
    )
    tile_bytes = 2 * Hk * BLOCK_SIZE * D * 4  # K and V of one block
    monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", 10 * tile_bytes)  # kept from 11 blocks on
    ops = CpuOps()
    assert ops.zeros((5, Hk, BLOCK_SIZE, D)) is not None and made == []  # too small ever to keep: none made
    num_blocks = 40
    k_cache, v_cache = ops.zeros((num_blocks, Hk, BLOCK_SIZE, D)), ops.zeros((num_blocks, Hk, BLOCK_SIZE, D))
    assert [m.size for m in made] == [k_cache.size, v_cache.size]
    assert all(not m.any() for m in made)  # zeros: padding read from it is finite

    def no_allocation_in_a_step(size):
        raise AssertionError("kept_memory called in a step")

    monkeypatch.setattr(attention, "kept_memory", no_allocation_in_a_step)
    kept_views = []
    gather = attention.DecodeKV.gather
    monkeypatch.setattr(
        attention.DecodeKV, "gather", lambda *a: kept_views.append(gather(*a)) or kept_views[-1]
    )

    rng = np.random.default_rng(3)
    free = list(rng.permutation(num_blocks))
    seqs = []  # [length in the cache, blocks]

    def admit(length):
        blocks = [free.pop() for _ in range(-(-(length + 12) // BLOCK_SIZE))]  # room for 12 decodes
        prompt = build_batch([ScheduledChunk([0] * length, 0, blocks, True)], BLOCK_SIZE)
        kv = rng.standard_normal((length, Hk, D)).astype(np.float32)
        ops.store_kv(kv, kv - 1, k_cache, v_cache, prompt.slot_mapping)
        seqs.append([length, blocks])

    for length in (3, 6):
        admit(length)
    keeps = []
    for step in range(12):
        if step in (2, 3, 7):  # decodes join, one by one and between kept steps
            admit(int(rng.integers(2, 9)))
        batch = build_batch([ScheduledChunk([0], n, blocks, True) for n, blocks in seqs], BLOCK_SIZE)
        kv = rng.standard_normal((len(seqs), Hk, D)).astype(np.float32)
        ops.store_kv(kv, kv * 3, k_cache, v_cache, batch.slot_mapping)
        q = rng.standard_normal((len(seqs), Hq, D)).astype(np.float32)
        plan = attention.AttentionPlan(batch, *k_cache.shape)
        keeps.append((plan.keeps_decode_kv, plan.decode_blocks.shape[1]))
        got = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
        gathered = attention.paged_attention(q, k_cache, v_cache, plan, attention.GatherBuffers(), 0.3)
        np.testing.assert_array_equal(got, gathered)
        for s in seqs:
            s[0] += 1
    kept_widths = {width for kept, width in keeps if kept}
    assert not keeps[0][0] and keeps[-1][0] and len(kept_widths) >= 2  # switched on; laid out anew since
    assert len(kept_views) == sum(kept for kept, _ in keeps)
    for views in kept_views:
        for view, memory in zip(views, made):
            assert np.shares_memory(view, memory)


# In a fresh interpreter, as tests/unit/test_cpu_ops.py measures the cache's own memory.
MEASURE_KEPT_MEMORY = """
import os
from minisarathi.backends.cpu.attention import DECODE_GROUP_BYTES, kept_memory

def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = resident_bytes()
memory = kept_memory(16 << 20)      # float32, 64 MiB of room
print(resident_bytes() - before, DECODE_GROUP_BYTES, memory.nbytes)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.system  # a fresh interpreter measures its own memory
def test_kept_memory_is_resident_for_the_switch_and_room_beyond():
    """Resident from the start for what the first kept step copies (so that step faults in no page), the rest
    of the room not until used (else the pool's resident memory would double)."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE_KEPT_MEMORY],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
    )
    grown, written, room = map(int, done.stdout.split())
    assert room == 64 << 20
    assert 0.9 * written <= grown <= written + (4 << 20), (
        f"{grown >> 20} MiB resident, {written >> 20} MiB written"
    )
