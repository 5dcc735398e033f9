"""Scheduling policies as pure logic: a fake model appends tokens; every step is checked against each policy's rules."""
import random

import pytest

from minisarathi.config import EngineConfig
from minisarathi.engine.block_manager import BlockManager
from minisarathi.engine.scheduler import POLICIES, make_scheduler
from minisarathi.engine.sequence import Sequence, SequenceStatus
from minisarathi.outputs import RequestMetrics
from minisarathi.sampling_params import SamplingParams

MAX_MODEL_LEN = 256


def make_seq(seq_id, prompt_len, max_tokens, shared_prefix=()):
    prompt = list(shared_prefix) + [(seq_id * 7 + i) % 500 for i in range(prompt_len - len(shared_prefix))]
    seq = Sequence(f"r{seq_id}", None, prompt, SamplingParams(max_tokens=max_tokens), RequestMetrics(0.0),
                   max_kv_tokens=prompt_len + max_tokens - 1)
    seq.seq_id = seq_id
    return seq


def workload(seed, num=12, num_blocks=16, block_size=4):
    rng = random.Random(seed)
    shared = [rng.randrange(500) for _ in range(20)]
    seqs = []
    for i in range(num):
        max_tokens = rng.randint(1, 24)
        prompt_len = rng.randint(1, min(60, num_blocks * block_size - max_tokens))
        prefix = shared[:min(prompt_len, rng.choice([0, 8, 20]))]
        seqs.append((rng.randint(0, 30), make_seq(i, prompt_len, max_tokens, prefix)))
    return seqs


def drive(policy, arrivals, num_blocks, block_size, chunk_size, max_num_seqs=8, caching=False):
    """Run the policy to the end under a fake model; check the shared rules every step; return the steps."""
    config = EngineConfig(scheduler=policy, chunk_size=chunk_size, block_size=block_size,
                          num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs, enable_prefix_caching=caching)
    blocks = BlockManager(num_blocks, block_size, caching)
    scheduler = make_scheduler(config, blocks, MAX_MODEL_LEN)
    pending = sorted(arrivals, key=lambda a: (a[0], a[1].seq_id))
    steps = []
    for step in range(10_000):
        while pending and pending[0][0] <= step:
            scheduler.add(pending.pop(0)[1])
        if not (scheduler.waiting or scheduler.running):
            if not pending:
                break
            continue
        before = {"running": list(scheduler.running), "decoding": [s for s in scheduler.running if not s.in_prefill],
                  "prefilling": {s: s.in_prefill for s in scheduler.running}}
        out = scheduler.schedule()
        assert out.scheduled, "work left but nothing scheduled"
        before["uncomputed"] = {seq: seq.num_uncomputed_tokens for seq in out.scheduled}
        before["num_blocks"] = {seq: len(seq.block_table) for seq in out.scheduled}
        for seq, n in out.scheduled.items():
            assert seq.status is SequenceStatus.RUNNING and 1 <= n <= seq.num_uncomputed_tokens
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n
            before["prefilling"].setdefault(seq, True)       # admitted this step
        if out.preempted:
            assert max((s.seq_id for s in scheduler.running), default=-1) < min(s.seq_id for s in out.preempted)
            assert list(scheduler.waiting)[:len(out.preempted)] == sorted(out.preempted, key=lambda s: s.seq_id)
        steps.append((before, out))
        finished = []
        for seq, n in out.scheduled.items():   # the fake model: compute, and sample at the end of a chunk
            seq.num_computed_tokens += n
            blocks.register_computed(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append((seq.seq_id * 13 + seq.num_tokens) % 500)
                if len(seq.output_token_ids) == seq.params.max_tokens:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"   # as the engine's _finish
                    finished.append(seq)
        scheduler.remove_finished(finished)
        blocks.check_invariants(scheduler.running)
        assert all(not s.block_table for s in scheduler.waiting)
    assert not scheduler.waiting and not scheduler.running and not pending, "did not finish"
    assert all(seq.is_finished for _, seq in arrivals)
    blocks.check_invariants([])
    assert blocks.num_free_blocks == num_blocks
    return steps, scheduler


def is_prefill(before, seq):
    return before["prefilling"][seq]


CASES = [(seed, caching) for seed in range(4) for caching in (False, True)]


@pytest.mark.parametrize("seed,caching", CASES)
def test_sarathi_stall_free_within_budget(seed, caching):
    steps, scheduler = drive("sarathi", workload(seed), 16, 4, chunk_size=10, caching=caching)
    for before, out in steps:
        assert out.num_tokens <= 10
        for seq in before["decoding"]:    # every running decode is in the batch (unless preempted)
            assert out.scheduled.get(seq) == 1 or seq in out.preempted
    assert any(any(is_prefill(b, s) for s in o.scheduled) and b["decoding"] for b, o in steps), "no hybrid batch"
    if seed == 0:
        assert scheduler.num_preemptions > 0


@pytest.mark.parametrize("seed,caching", CASES)
def test_vllm_batches_are_prefill_only_or_decode_only(seed, caching):
    steps, _ = drive("vllm", workload(seed), 16, 4, chunk_size=10, caching=caching)
    for before, out in steps:
        kinds = {is_prefill(before, s) for s in out.scheduled}
        assert len(kinds) == 1
        if kinds == {True}:   # whole prompts, never cut to the chunk size
            assert all(n == before["uncomputed"][s] for s, n in out.scheduled.items())


@pytest.mark.parametrize("seed,caching", CASES)
def test_simple_chunking_alternates_without_hybrid_batches(seed, caching):
    steps, _ = drive("simple_chunking", workload(seed), 16, 4, chunk_size=10, caching=caching)
    last_prefill = False
    for before, out in steps:
        kinds = {is_prefill(before, s) for s in out.scheduled}
        assert len(kinds) == 1
        if True in kinds:
            assert out.num_tokens <= 10
            waited = [s for s in before["decoding"] if s not in out.preempted]
            assert not (last_prefill and waited), "two prefill batches in a row while decodes wait"
        last_prefill = True in kinds


@pytest.mark.parametrize("seed,caching", CASES)
def test_orca_reserves_final_length_and_never_preempts(seed, caching):
    steps, scheduler = drive("orca", workload(seed), 16, 4, chunk_size=10, caching=caching)
    assert scheduler.num_preemptions == 0
    for before, out in steps:
        for seq in before["decoding"]:
            assert out.scheduled.get(seq) == 1
        for seq in out.scheduled:
            assert before["num_blocks"][seq] == -(-seq.max_kv_tokens // 4)


@pytest.mark.parametrize("seed,caching", CASES)
def test_faster_transformer_is_static_batching(seed, caching):
    steps, scheduler = drive("faster_transformer", workload(seed), 16, 4, chunk_size=10, caching=caching)
    assert scheduler.num_preemptions == 0
    for before, out in steps:
        admitted = [s for s in out.scheduled if s not in before["running"]]
        assert not admitted or not before["running"], "admitted while a batch runs"


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_one_sequence_that_fills_the_pool_runs_alone(policy):
    arrivals = [(0, make_seq(0, 30, 34)), (0, make_seq(1, 5, 4)), (1, make_seq(2, 9, 9))]   # r0 needs 63 slots
    drive(policy, arrivals, num_blocks=16, block_size=4, chunk_size=8)


def test_sarathi_preempts_newest_and_requeues_it_first():
    blocks = BlockManager(num_blocks=4, block_size=2)
    scheduler = make_scheduler(EngineConfig(chunk_size=8, block_size=2), blocks, MAX_MODEL_LEN)
    old, new = make_seq(0, 3, 8), make_seq(1, 3, 8)
    scheduler.add(old)
    scheduler.add(new)
    out = scheduler.schedule()
    assert out.scheduled == {old: 3, new: 3}           # two blocks each: the pool is full
    for seq in (old, new):
        seq.num_computed_tokens += 3
        seq.output_token_ids.append(5)
    out = scheduler.schedule()                          # both decode at position 3: still in their blocks
    assert out.scheduled == {old: 1, new: 1} and not out.preempted
    for seq in (old, new):
        seq.num_computed_tokens += 1
        seq.output_token_ids.append(5)
    out = scheduler.schedule()                          # position 4 needs a third block each: none free
    assert out.scheduled == {old: 1} and out.preempted == [new]
    assert list(scheduler.waiting) == [new] and new.block_table == [] and new.num_computed_tokens == 0
    assert new.num_tokens == 5                          # it keeps its generated tokens and recomputes them
    blocks.check_invariants([old])


def test_admission_respects_max_num_seqs_and_fcfs():
    blocks = BlockManager(num_blocks=64, block_size=4)
    scheduler = make_scheduler(EngineConfig(chunk_size=100, max_num_seqs=2), blocks, MAX_MODEL_LEN)
    seqs = [make_seq(i, 5, 3) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert list(out.scheduled) == seqs[:2] and list(scheduler.waiting) == seqs[2:]


def test_sarathi_splits_a_long_prompt_into_chunks():
    blocks = BlockManager(num_blocks=64, block_size=4)
    scheduler = make_scheduler(EngineConfig(chunk_size=16), blocks, MAX_MODEL_LEN)
    seq = make_seq(0, 40, 2)
    scheduler.add(seq)
    grants = []
    while seq.in_prefill or not grants:
        (n,) = scheduler.schedule().scheduled.values()
        grants.append(n)
        seq.num_computed_tokens += n
    assert grants == [16, 16, 8]
    assert len(seq.block_table) == 10
