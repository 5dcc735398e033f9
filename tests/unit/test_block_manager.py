"""Block manager: allocation, ref counts, prefix cache (chained hashes, LRU eviction), invariants."""

import hashlib

import numpy as np
import pytest

from minisarathi.engine.block_manager import BlockManager
from minisarathi.engine.sequence import Sequence
from minisarathi.outputs import RequestMetrics
from minisarathi.sampling_params import SamplingParams


def make_seq(tokens, name="r"):
    return Sequence(name, None, list(tokens), SamplingParams(), RequestMetrics(0.0), max_kv_tokens=10_000)


def admit(bm, seq, num_tokens=None):
    cached = bm.lookup_prefix(seq)
    bm.admit(seq, cached)
    bm.grow(seq, seq.num_tokens if num_tokens is None else num_tokens)
    return cached


def compute_all(bm, seq):
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq, seq.num_computed_tokens)


def test_lazy_growth_and_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(6))
    admit(bm, seq, 3)
    assert len(seq.block_table) == 1 and bm.num_free_blocks == 7
    bm.grow(seq, 9)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.grow(seq, 9)  # already covered
    assert len(seq.block_table) == 3
    bm.check_invariants([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []
    bm.check_invariants([])


def test_max_growth_counts_last_block_space():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(range(5))
    admit(bm, seq, 5)  # 2 blocks, 3 free slots in the second
    seq.num_computed_tokens = 5
    assert bm.max_growth(seq) == 3 + 2 * 4


def test_out_of_blocks_raises():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(range(12))
    with pytest.raises(RuntimeError):
        admit(bm, seq)


def test_prefix_cache_shares_full_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_seq(range(10), "a")
    assert admit(bm, a) == []
    compute_all(bm, a)  # blocks 0, 1 full and registered; block 2 partial
    b = make_seq(list(range(8)) + [99, 98, 97], "b")
    cached = admit(bm, b)
    assert cached == a.block_table[:2]
    assert b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in cached] == [2, 2]
    assert b.block_table[2] != a.block_table[2]  # the first block it writes is its own
    bm.check_invariants([a, b])
    assert (bm.prefix_queries, bm.prefix_hits) == (10 + 11, 8)


def test_prefix_cache_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_seq(range(8), "a")
    admit(bm, a)
    compute_all(bm, a)
    same = make_seq(range(8), "same")  # identical prompt, exactly 2 full blocks
    assert admit(bm, same) == a.block_table[:1]  # the last block is recomputed, not shared
    assert same.num_computed_tokens == 4
    bm.check_invariants([a, same])


def test_chained_hash_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    admit(bm, a)
    compute_all(bm, a)
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")  # same second block, different first block
    assert admit(bm, b) == []


def test_block_keys_are_chained_sha256():
    """Keys a client cannot make collide (vLLM's CVE-2025-25183 came from Python's hash())."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    admit(bm, a)
    compute_all(bm, a)
    first = hashlib.sha256(np.array([1, 2, 3, 4], np.int32).tobytes()).digest()
    second = hashlib.sha256(first + np.array([5, 6, 7, 8], np.int32).tobytes()).digest()
    assert a.block_hashes == [first, second]
    assert bm.cached_blocks == {first: a.block_table[0], second: a.block_table[1]}


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5], "a")
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)  # blocks [1,2] and [3,4] cached, the partial one free
    assert bm.num_free_blocks == 4 and len(bm.evictable) == 2
    bm.check_invariants([])
    again = make_seq([1, 2, 3, 4, 7], "again")
    assert len(admit(bm, again)) == 2  # revived from the evictable list
    bm.check_invariants([again])
    bm.free(again)
    # tail blocks are freed first, so the LRU order evicts [3,4] before the more shared [1,2]
    other = make_seq([9, 9, 9, 9, 9], "other")
    admit(bm, other)  # 3 blocks: the 2 free ones, then evicts one
    compute_all(bm, other)
    bm.check_invariants([other])
    probe = make_seq([1, 2, 0], "probe")
    assert len(bm.lookup_prefix(probe)) == 1  # [1,2] survived, [3,4] was evicted
    probe_34 = make_seq([1, 2, 3, 4, 0], "probe34")
    assert len(bm.lookup_prefix(probe_34)) == 1


def test_can_admit_counts_revived_blocks_and_watermark():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5], "a")
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 6], "b")
    cached = bm.lookup_prefix(b)
    assert len(cached) == 2
    assert bm.can_admit(b, cached, 5, watermark=0)  # 2 revived + 1 new = 3
    assert not bm.can_admit(b, cached, 5, watermark=1)
    assert not bm.can_admit(b, cached, 7, watermark=0)  # 4 blocks > 3


def test_twin_blocks_computed_concurrently_stay_private():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a, b = make_seq([1, 2, 3], "a"), make_seq([1, 2, 3], "b")
    admit(bm, a)
    admit(bm, b)  # nothing cached yet: both compute [1,2]
    compute_all(bm, a)
    compute_all(bm, b)
    bm.check_invariants([a, b])
    assert list(bm.cached_blocks.values()) == [a.block_table[0]]
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 8


def test_check_invariants_catches_a_leak():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq([1, 2, 3])
    admit(bm, seq)
    with pytest.raises(AssertionError):
        bm.check_invariants([])  # the sequence's blocks are unaccounted for


def test_tables_matrix_mirrors_block_tables_as_it_grows():
    """Each admitted sequence's row of `tables` is its block table, zero-padded, through row and width
    growth."""
    bm = BlockManager(num_blocks=200, block_size=1)
    seqs = [make_seq(range(3), f"s{i}") for i in range(20)]  # more than the initial 16 rows
    for seq in seqs:
        admit(bm, seq)
    bm.grow(seqs[0], 40)  # wider than the initial 16 columns
    bm.check_invariants(seqs)
    assert bm.tables.shape[0] >= 20 and bm.tables.shape[1] >= 40
    assert bm.tables[seqs[0].block_row, :40].tolist() == seqs[0].block_table
    freed_row = seqs[5].block_row
    bm.free(seqs[5])
    assert not bm.tables[freed_row].any()  # zeroed for the next sequence
    again = make_seq(range(7), "again")
    admit(bm, again)
    assert again.block_row == freed_row
    bm.check_invariants([s for s in seqs if s is not seqs[5]] + [again])


def test_a_pending_copy_source_is_no_destination_in_the_same_step():
    # two requests forked at a partial block each; the first copy empties the free list
    bm = BlockManager(num_blocks=5, block_size=4)
    p, q, p_child, q_child = (make_seq(range(5), name) for name in "pqPQ")
    for parent, child in ((p, p_child), (q, q_child)):
        admit(bm, parent)
        parent.num_computed_tokens = 5
        bm.fork(parent, child)
    bm.grow(p, 6)  # copies its shared tail into the last free block
    ((source, _),) = bm.pending_copies
    bm.free(p_child)  # preempted in the same pass: it held the source's last other reference
    if bm.max_growth(q) >= 1:  # the scheduler grows q only if the manager says there is room
        bm.grow(q, 6)
    sources = {s for s, _ in bm.pending_copies}
    assert not sources & {d for _, d in bm.pending_copies}, "a step's copies run in parallel"
    bm.check_invariants([p, q, q_child])
    bm.take_copies()  # once copied, the source is free again
    assert source in bm.free_blocks
    bm.check_invariants([p, q, q_child])
