"""Scheduling policies as pure logic: a fake model appends tokens; every step is checked against each policy's
rules."""

import logging
import random

import numpy as np
import pytest

from minisarathi.config import EngineConfig
from minisarathi.engine.block_manager import BlockManager
from minisarathi.engine.cost_model import CostModel, step_shape
from minisarathi.engine.scheduler import POLICIES
from minisarathi.engine.sequence import Sequence, SequenceStatus
from minisarathi.engine.slo_scheduler import make_scheduler
from minisarathi.outputs import RequestMetrics
from minisarathi.sampling_params import SamplingParams

MAX_MODEL_LEN = 256


def make_seq(seq_id, prompt_len, max_tokens, shared_prefix=()):
    prompt = list(shared_prefix) + [(seq_id * 7 + i) % 500 for i in range(prompt_len - len(shared_prefix))]
    seq = Sequence(
        f"r{seq_id}",
        None,
        prompt,
        SamplingParams(max_tokens=max_tokens),
        RequestMetrics(0.0),
        max_kv_tokens=prompt_len + max_tokens - 1,
    )
    seq.seq_id = seq_id
    return seq


def workload(seed, num=12, num_blocks=16, block_size=4):
    rng = random.Random(seed)
    shared = [rng.randrange(500) for _ in range(20)]
    seqs = []
    for i in range(num):
        max_tokens = rng.randint(1, 24)
        prompt_len = rng.randint(1, min(60, num_blocks * block_size - max_tokens))
        prefix = shared[: min(prompt_len, rng.choice([0, 8, 20]))]
        seqs.append((rng.randint(0, 30), make_seq(i, prompt_len, max_tokens, prefix)))
    return seqs


def drive(
    policy,
    arrivals,
    num_blocks,
    block_size,
    chunk_size,
    max_num_seqs=8,
    caching=False,
    cost_model=None,
    on_schedule=None,
    **options,
):
    """Run the policy to the end under a fake model; check the shared rules every step; return the steps.
    Each sequence's metrics get the step numbers of its first scheduling and its first token.
    options: more EngineConfig fields; cost_model: the scheduler's (tbt_slo_ms mode); on_schedule(scheduler,
    out) is called right after each schedule()."""
    config = EngineConfig(
        scheduler=policy,
        chunk_size=chunk_size,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=caching,
        **options,
    )
    blocks = BlockManager(num_blocks, block_size, caching)
    scheduler = make_scheduler(config, blocks, MAX_MODEL_LEN, cost_model)
    pending = sorted(arrivals, key=lambda a: (a[0], a[1].seq_id))
    steps = []
    for step in range(10_000):
        while pending and pending[0][0] <= step:
            arrival, seq = pending.pop(0)
            seq.metrics.arrival_time = float(arrival)
            scheduler.add(seq)
        if not (scheduler.waiting or scheduler.running):
            if not pending:
                break
            continue
        before = {
            "running": list(scheduler.running),
            "decoding": [s for s in scheduler.running if not s.in_prefill],
            "prefilling": {s: s.in_prefill for s in scheduler.running},
        }
        out = scheduler.schedule()
        assert out.scheduled, "work left but nothing scheduled"
        if on_schedule:
            on_schedule(scheduler, out)
        before["uncomputed"] = {seq: seq.num_uncomputed_tokens for seq in out.scheduled}
        before["num_blocks"] = {seq: len(seq.block_table) for seq in out.scheduled}
        for seq, n in out.scheduled.items():
            assert seq.status is SequenceStatus.RUNNING and 1 <= n <= seq.num_uncomputed_tokens
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n
            before["prefilling"].setdefault(seq, True)  # admitted this step
        scheduler.check_invariants()
        if out.preempted:  # the victims are the last in queue order, and wait at their place in it
            assert max((s.queue_key for s in scheduler.running), default=(-1,)) < min(
                s.queue_key for s in out.preempted
            )
        assert [s.queue_key for s in scheduler.waiting] == sorted(s.queue_key for s in scheduler.waiting)
        steps.append((before, out))
        finished = []
        for seq, n in out.scheduled.items():  # the fake model: compute, and sample at the end of a chunk
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = step
            seq.num_computed_tokens += n
            blocks.register_computed(seq, seq.num_computed_tokens)
            if seq.num_computed_tokens == seq.num_tokens:
                if seq.metrics.first_token_time is None:
                    seq.metrics.first_token_time = step
                seq.output_token_ids.append((seq.seq_id * 13 + seq.num_tokens) % 500)
                if len(seq.output_token_ids) == seq.params.max_tokens:
                    seq.status, seq.finish_reason = (
                        SequenceStatus.FINISHED,
                        "length",
                    )  # as the engine's _finish
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
        for seq in before["decoding"]:  # every running decode is in the batch (unless preempted)
            assert out.scheduled.get(seq) == 1 or seq in out.preempted
    assert any(any(is_prefill(b, s) for s in o.scheduled) and b["decoding"] for b, o in steps), (
        "no hybrid batch"
    )
    if seed == 0:
        assert scheduler.num_preemptions > 0


@pytest.mark.parametrize("seed,caching", CASES)
def test_vllm_batches_are_prefill_only_or_decode_only(seed, caching):
    steps, _ = drive("vllm", workload(seed), 16, 4, chunk_size=10, caching=caching)
    for before, out in steps:
        kinds = {is_prefill(before, s) for s in out.scheduled}
        assert len(kinds) == 1
        if kinds == {True}:  # whole prompts, never cut to the chunk size
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
    arrivals = [(0, make_seq(0, 30, 34)), (0, make_seq(1, 5, 4)), (1, make_seq(2, 9, 9))]  # r0 needs 63 slots
    drive(policy, arrivals, num_blocks=16, block_size=4, chunk_size=8)


def test_sarathi_preempts_newest_and_requeues_it_first():
    blocks = BlockManager(num_blocks=4, block_size=2)
    scheduler = make_scheduler(EngineConfig(chunk_size=8, block_size=2), blocks, MAX_MODEL_LEN)
    old, new = make_seq(0, 3, 8), make_seq(1, 3, 8)
    scheduler.add(old)
    scheduler.add(new)
    out = scheduler.schedule()
    assert out.scheduled == {old: 3, new: 3}  # two blocks each: the pool is full
    for seq in (old, new):
        seq.num_computed_tokens += 3
        seq.output_token_ids.append(5)
    out = scheduler.schedule()  # both decode at position 3: still in their blocks
    assert out.scheduled == {old: 1, new: 1} and not out.preempted
    for seq in (old, new):
        seq.num_computed_tokens += 1
        seq.output_token_ids.append(5)
    out = scheduler.schedule()  # position 4 needs a third block each: none free
    assert out.scheduled == {old: 1} and out.preempted == [new]
    assert list(scheduler.waiting) == [new] and new.block_table == [] and new.num_computed_tokens == 0
    assert new.num_tokens == 5  # it keeps its generated tokens and recomputes them
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


# fair partial prefills
# -----------------------------------------------------------------------------------------

FAIR_LIMITS = [(1, 1), (2, 1), (3, 2)]  # (max_partial_prefills, max_long_partial_prefills)


@pytest.mark.parametrize("policy", ["sarathi", "simple_chunking"])
@pytest.mark.parametrize("limits", FAIR_LIMITS)
@pytest.mark.parametrize("seed", range(3))
def test_partial_prefill_limits_hold_every_step(policy, limits, seed):
    max_partial, max_long = limits
    stops = []
    steps, _ = drive(
        policy,
        workload(seed, num=16),
        32,
        4,
        chunk_size=12,
        caching=seed == 1,
        on_schedule=lambda _, out: stops.append(out.admission_stop),
        max_partial_prefills=max_partial,
        long_prefill_threshold=20,
        max_long_partial_prefills=max_long,
    )
    assert "partial_prefills" in stops, "the limits never bound: the invariant went unexercised"
    for before, out in steps:
        if policy == "sarathi":
            assert out.num_tokens <= 12


def test_short_prompts_overtake_a_long_one():
    def arrivals():  # one 200-token prompt, then short ones arriving while it prefills
        return [(0, make_seq(0, 200, 2))] + [(1 + 2 * i, make_seq(1 + i, 6, 2)) for i in range(4)]

    def ttft(seq):  # in steps, from arrival (arrival = the step it was added)
        return seq.metrics.first_token_time - seq.metrics.arrival_time

    fcfs, fair = arrivals(), arrivals()
    drive("sarathi", fcfs, 128, 4, chunk_size=16)
    drive("sarathi", fair, 128, 4, chunk_size=16, max_partial_prefills=2, long_prefill_threshold=32)
    assert all(ttft(seq) >= 5 for _, seq in fcfs[1:3])  # behind the long prompt's 13 chunks
    assert all(ttft(seq) <= 1 for _, seq in fair[1:])  # half the budget each step: 6 tokens fit at once
    assert ttft(fair[0][1]) <= ttft(fcfs[0][1]) + 4  # the long one's cost: a few steps


def test_a_long_prompt_over_the_limit_is_passed_over():
    blocks = BlockManager(num_blocks=64, block_size=4)
    config = EngineConfig(chunk_size=16, max_partial_prefills=3, long_prefill_threshold=20)
    scheduler = make_scheduler(config, blocks, MAX_MODEL_LEN)
    first_long, second_long, short = make_seq(0, 60, 2), make_seq(1, 60, 2), make_seq(2, 8, 2)
    for seq in (first_long, second_long, short):
        scheduler.add(seq)
    out = scheduler.schedule()
    # shares: the first long one and the short one (the second long is over max_long_partial_prefills = 1)
    assert out.scheduled == {first_long: 8, short: 8}
    assert scheduler.waiting == [second_long] and out.admission_stop == "partial_prefills"


# priorities
# ------------------------------------------------------------------------------------------------------


def test_priority_orders_the_waiting_queue_and_ages():
    blocks = BlockManager(num_blocks=64, block_size=4)
    scheduler = make_scheduler(
        EngineConfig(chunk_size=100, max_num_seqs=2, priority_aging_s=10), blocks, MAX_MODEL_LEN
    )
    seqs = [make_seq(i, 5, 3) for i in range(4)]
    for seq, priority in zip(seqs, [1, 0, 2, 0]):
        seq.priority = priority
        scheduler.add(seq)
    out = scheduler.schedule()
    assert list(out.scheduled) == [seqs[1], seqs[3]] and scheduler.waiting == [seqs[0], seqs[2]]
    assert out.admission_stop == "max_num_seqs"
    # aging: priority 1 at t=0 ranks as priority 0 at t=10, so between arrivals at t=5 and t=15
    early, late = make_seq(4, 5, 3), make_seq(5, 5, 3)
    early.metrics.arrival_time, late.metrics.arrival_time = 5.0, 15.0
    scheduler.add(late)
    scheduler.add(early)
    assert scheduler.waiting == [early, seqs[0], late, seqs[2]]


def test_preemption_victim_is_the_lowest_priority_then_the_newest():
    blocks = BlockManager(num_blocks=6, block_size=2)
    scheduler = make_scheduler(EngineConfig(chunk_size=8, block_size=2), blocks, MAX_MODEL_LEN)
    old_low, new_high, newest_high = make_seq(0, 3, 8), make_seq(1, 3, 8), make_seq(2, 3, 8)
    old_low.priority = 1
    for seq in (old_low, new_high, newest_high):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert list(out.scheduled) == [new_high, newest_high, old_low]  # queue order: priority, then arrival
    for seq in out.scheduled:
        seq.num_computed_tokens += 3
        seq.output_token_ids.append(5)
    for _ in range(2):  # positions 3 (in their blocks) and 4 (a third block each: none free)
        out = scheduler.schedule()
        for seq in out.scheduled:
            seq.num_computed_tokens += 1
            seq.output_token_ids.append(5)
    assert out.preempted == [old_low] and set(out.scheduled) == {new_high, newest_high}
    assert scheduler.waiting == [old_low]
    out = scheduler.schedule()  # position 5: the newest of the two high-priority ones goes next
    assert out.preempted == [] and set(out.scheduled) == {new_high, newest_high}
    for seq in out.scheduled:
        seq.num_computed_tokens += 1
        seq.output_token_ids.append(5)
    out = scheduler.schedule()
    assert out.preempted == [newest_high]


def test_preemption_victim_is_the_latest_aged_key():
    """Unequal priorities: the victim is the latest virtual arrival, not the lowest priority. A priority-1
    request arrived at t=0 (key 0 + 1 x 10) is kept; the priority-0 one arrived at t=20 (key 20) is
    preempted."""
    blocks = BlockManager(num_blocks=4, block_size=2)
    scheduler = make_scheduler(
        EngineConfig(chunk_size=8, block_size=2, priority_aging_s=10.0), blocks, MAX_MODEL_LEN
    )
    old_low, new_high = make_seq(0, 3, 8), make_seq(1, 3, 8)
    old_low.priority, new_high.metrics.arrival_time = 1, 20.0
    scheduler.add(new_high)
    scheduler.add(old_low)
    out = scheduler.schedule()
    assert list(out.scheduled) == [old_low, new_high]
    for _ in range(2):  # positions 3 (in their second blocks), then 4: a third block each, none free
        for seq in out.scheduled:
            seq.num_computed_tokens += out.scheduled[seq]
            seq.output_token_ids.append(5)
        out = scheduler.schedule()
    assert out.preempted == [new_high] and list(out.scheduled) == [old_low]


def test_partial_prefill_limits_are_an_engine_invariant():
    """engine.check_invariants checks the fair-prefill limits through the scheduler."""
    from minisarathi.engine.engine import LLMEngine

    engine = LLMEngine(
        chunk_size=8, block_size=4, num_kv_blocks=32, max_partial_prefills=2, long_prefill_threshold=100
    )
    engine.add_request("a", list(range(3, 23)))
    engine.add_request("b", list(range(3, 23)))
    engine.step()
    engine.check_invariants()  # two 20-token prompts mid-prefill: within the limits
    engine.scheduler.max_partial_prefills = 1  # the same state under a tighter limit
    with pytest.raises(AssertionError, match="max_partial_prefills"):
        engine.check_invariants()
    engine.scheduler.max_partial_prefills, engine.scheduler.long_prefill_threshold = 2, 4
    with pytest.raises(AssertionError, match="max_long_partial_prefills"):
        engine.check_invariants()


@pytest.mark.parametrize("aging", [10, 10**9])
def test_starvation_is_bounded_by_aging(aging):
    """A priority-2 request arriving at step 10 into the queue of a saturating stream of priority-0 ones: with
    aging A it ranks as a priority-0 request arriving at step 10 + 2 A, so no request arriving after that
    goes before it. Without aging (A huge) it waits for the whole stream."""
    low = make_seq(0, 4, 4)
    low.priority = 2
    stream = [(step, make_seq(1 + step, 4, 4)) for step in range(80)]
    drive("sarathi", [(10, low)] + stream, 64, 4, chunk_size=16, max_num_seqs=2, priority_aging_s=aging)
    started = low.metrics.first_scheduled_time
    overtook = [seq for arrival, seq in stream if seq.metrics.first_scheduled_time < started]
    if aging == 10:
        assert all(seq.metrics.arrival_time <= 10 + 2 * aging for seq in overtook)
        assert any(seq.metrics.arrival_time > 10 for seq in overtook), "the stream should have overtaken it"
    else:
        assert len(overtook) == len(stream)


# tbt_slo_ms: the budget from a latency target
# -------------------------------------------------------------------

# seconds: per step, per prefill token, per decode, per unit of prefill attention, per unit of decode
# attention
KNOWN_COSTS = (2e-3, 1e-3, 0.5e-3, 1e-5, 2e-5)


def known_cost_model(coefficients=KNOWN_COSTS):
    model = CostModel()
    model.coefficients = np.array(coefficients)
    return model


@pytest.mark.parametrize("target_ms", [30, 3.5])
@pytest.mark.parametrize("seed", range(4))
def test_slo_budget_keeps_the_predicted_step_time_under_the_limit(seed, target_ms):
    """Every step's predicted time stays within target - margin, except by the liveness grants (a block's
    worth for a prompt mid-prefill, or for the first prompt of an empty step); 3.5 ms is below what the
    decodes alone often take (overload), and every request still finishes."""
    model = known_cost_model()
    seen = {"time_bound": 0, "overloaded": 0}

    def check(scheduler, out):
        predicted = model.predict(step_shape(out.scheduled))
        assert out.time_limit == pytest.approx(scheduler.slo.target - scheduler.slo.margin)
        # the decodes always run; besides them only the liveness grants (a block: 4 tokens) may pass the limit
        decodes = model.predict(
            step_shape({seq: n for seq, n in out.scheduled.items() if not seq.in_prefill})
        )
        floor_grants = sum(
            model.prefill_time(seq.num_computed_tokens, n)
            for seq, n in out.scheduled.items()
            if seq.in_prefill and n <= 4
        )
        assert predicted - floor_grants <= max(out.time_limit, decodes) + 1e-12
        if out.overloaded:
            seen["overloaded"] += 1
            assert not any(seq.num_computed_tokens == 0 for seq in out.scheduled), "admitted while overloaded"
        elif out.num_tokens < 64 and any(n < seq.num_uncomputed_tokens for seq, n in out.scheduled.items()):
            seen["time_bound"] += 1  # a prompt cut short of the token budget

    drive(
        "sarathi",
        workload(seed, num=16),
        64,
        4,
        chunk_size=64,
        caching=seed % 2 == 1,
        cost_model=model,
        on_schedule=check,
        tbt_slo_ms=target_ms,
    )
    assert seen["time_bound"] > 0, "the time limit never bound a step"
    if target_ms == 3.5:
        assert seen["overloaded"] > 0


def test_slo_budget_takes_the_largest_prefill_that_fits():
    model = known_cost_model()
    scheduler = make_scheduler(
        EngineConfig(chunk_size=512, block_size=4, tbt_slo_ms=40),
        BlockManager(num_blocks=128, block_size=4),
        MAX_MODEL_LEN,
        model,
    )
    seq = make_seq(0, 250, 2)
    scheduler.add(seq)
    out = scheduler.schedule()
    n = out.scheduled[seq]
    limit = out.time_limit
    assert limit == pytest.approx(0.9 * 0.040)  # the initial margin: 10% of the target
    assert model.predict(step_shape(out.scheduled)) <= limit < model.predict(step_shape({seq: n + 1}))
    assert out.admission_stop is None and 0 < n < 250


def test_overload_stops_admission_and_keeps_the_decodes(caplog):
    model = known_cost_model((2e-3, 1e-3, 10e-3, 0, 0))  # a decode costs 10 ms: three take 32 ms
    scheduler = make_scheduler(
        EngineConfig(chunk_size=64, block_size=4, tbt_slo_ms=30),
        BlockManager(num_blocks=64, block_size=4),
        MAX_MODEL_LEN,
        model,
    )
    running = [make_seq(i, 4, 8) for i in range(3)]
    for seq in running:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert list(out.scheduled) == running and not out.overloaded
    for seq in running:
        seq.num_computed_tokens += 4
        seq.output_token_ids.append(5)
    newcomer = make_seq(3, 4, 8)
    scheduler.add(newcomer)
    with caplog.at_level(logging.WARNING):
        out = scheduler.schedule()
    assert out.overloaded and out.admission_stop == "overload" and scheduler.slo.overloaded
    assert out.scheduled == {seq: 1 for seq in running} and scheduler.waiting == [newcomer]
    assert "overloaded" in caplog.text
    for seq in running:
        seq.num_computed_tokens += 1
        seq.output_token_ids.append(5)
    running[0].status, running[0].finish_reason = SequenceStatus.FINISHED, "length"
    scheduler.remove_finished([running[0]])
    out = scheduler.schedule()  # two decodes: 22 ms, 5 ms left for the prompt
    assert not out.overloaded and out.scheduled == {running[1]: 1, running[2]: 1, newcomer: 4}
    assert scheduler.slo.overloaded_steps == 1


def test_an_slo_below_a_single_decode_falls_back_to_the_fixed_budget(caplog):
    """One decode alone costs 12 ms, over the 10 ms target: stopping admission whenever a decode runs would
    serialize the requests (one at a time); the steps take the chunk_size budget instead, still counted as
    overloaded, with one warning."""
    model = known_cost_model((2e-3, 1e-3, 10e-3, 0, 0))
    arrivals = [(0, make_seq(i, 4, 6)) for i in range(4)]
    with caplog.at_level(logging.WARNING):
        steps, scheduler = drive("sarathi", arrivals, 64, 4, chunk_size=64, cost_model=model, tbt_slo_ms=10)
    assert len(steps) <= 8  # together: 6 tokens each in ~6 steps, not ~4 x 6 one after the other
    assert all(out.admission_stop != "overload" for _, out in steps)
    assert all(out.time_limit is None for _, out in steps if out.overloaded)
    assert scheduler.slo.overloaded_steps > 0 and scheduler.slo.summary()["infeasible"]
    assert caplog.text.count("below the predicted time of a single decode") == 1
