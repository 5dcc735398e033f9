"""LLMEngine on the bundled model: same greedy tokens every way, stall-free batches, aborts, bad input, no
leaks."""

import numpy as np
import pytest

from minisarathi.engine import engine as engine_module
from minisarathi.engine.engine import LLMEngine
from minisarathi.engine.scheduler import ADMISSION_STOPS
from minisarathi.paths import default_model_dir
from minisarathi.sampling_params import SamplingParams
from minisarathi.testing import ScheduledChunk, build_batch
from minisarathi.tokenizer import Tokenizer

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high. Lily's mom said, "
    '"Lily, let\'s go to the park." Lily was sad and didn\'t know what to do. She said, "I want to play '
    "with your ball, but I can't find it.\""
)


@pytest.fixture(scope="module")
def requests():
    """~6 greedy requests: 1 to 120 prompt tokens, some sharing long prefixes, 12-24 new tokens each."""
    tok = Tokenizer.from_pretrained(default_model_dir())
    story = tok.encode(STORY)
    assert len(story) >= 120
    prompts = [
        story[:120],
        story[:70] + tok.encode("Tom had a red")[1:],
        story[:3],
        "Lily and Tom went to the park.",
        story[:40],
        [1],
    ]
    return [
        (f"r{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, [24, 12, 20, 16, 24, 12]))
    ]


def run(engine, requests, stagger=3, on_step=None, priorities=None):
    """Add the first `stagger` requests, take two steps, add the rest, run to the end; check every step.
    priorities: request id -> priority (default 0)."""
    finals, streamed = {}, {}
    priorities = priorities or {}
    for rid, prompt, params in requests[:stagger]:
        engine.add_request(rid, prompt, params, priority=priorities.get(rid, 0))
    late = requests[stagger:]
    num_steps = 0
    while engine.has_unfinished_requests() or late:
        if num_steps == 2 or not engine.has_unfinished_requests():
            for rid, prompt, params in late:
                engine.add_request(rid, prompt, params, priority=priorities.get(rid, 0))
            late = []
        for out in engine.step():
            completion = out.outputs[0]
            before = streamed.get(out.request_id)
            if before is not None:  # cumulative and never retracted: no token is streamed twice
                tokens, text = before
                assert completion.token_ids[: len(tokens)] == tokens and completion.text.startswith(text)
                assert len(completion.token_ids) > len(tokens) or out.finished
            assert out.request_id not in finals, "a finished request reported again"
            streamed[out.request_id] = (completion.token_ids, completion.text)
            if out.finished:
                finals[out.request_id] = out
        engine.check_invariants()
        if on_step:
            on_step(engine)
        num_steps += 1
        assert num_steps < 5000, "no progress"
    assert_no_leaks(engine)
    return finals


def assert_no_leaks(engine):
    engine.check_invariants()
    blocks = engine.block_manager
    assert all(r == 0 for r in blocks.ref_counts)
    assert blocks.num_free_blocks == blocks.num_blocks  # free, or held only by the prefix cache


@pytest.fixture(scope="module")
def reference(requests):
    """Each request alone, whole prompt in one step."""
    engine = LLMEngine(scheduler="sarathi", chunk_size=512, block_size=16, num_kv_blocks=64)
    return {rid: run(engine, [(rid, p, sp)], stagger=1)[rid].outputs[0].token_ids for rid, p, sp in requests}


GRID = [  # (policy, chunk_size, block_size, prefix caching, KV blocks: None = plenty)
    (policy, chunk, block, caching, None)
    for policy in ("sarathi", "simple_chunking", "vllm", "orca", "faster_transformer")
    for chunk, block, caching in ((1, 16, False), (8, 1, True), (64, 32, True), (512, 16, True))
] + [
    (policy, chunk, block, caching, blocks)
    for policy in ("sarathi", "simple_chunking", "vllm", "orca", "faster_transformer")
    for chunk, block, caching, blocks in ((8, 16, True, 12), (64, 1, False, 170), (16, 8, False, 20))
]
PREEMPTING = ("sarathi", "simple_chunking", "vllm")


@pytest.mark.parametrize("policy,chunk,block,caching,num_blocks", GRID)
def test_greedy_tokens_identical_every_way(
    requests, reference, policy, chunk, block, caching, num_blocks, blas_core
):
    """Against each request alone, computed with this machine's matmul form; blas_core: either form here."""
    engine = LLMEngine(
        scheduler=policy,
        chunk_size=chunk,
        block_size=block,
        enable_prefix_caching=caching,
        num_kv_blocks=num_blocks or 1024 // block,
    )
    finals = run(engine, requests, on_step=check_batch_shape)
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == reference
    assert all(out.outputs[0].finish_reason == "length" for out in finals.values())
    if num_blocks is not None and policy in PREEMPTING:
        assert engine.scheduler.num_preemptions > 0, "the small pool should force preemptions"
        assert any(out.metrics.preemption_times for out in finals.values())
    if policy in ("orca", "faster_transformer"):
        assert engine.scheduler.num_preemptions == 0
    if caching and chunk < 64:
        assert engine.stats()["prefix_cache_hits"] > 0


# The scheduling options of docs/scheduling.md's "SLO-driven budget", "Fair partial prefills" and
# "Priorities": (options, priorities by request id). 0.3 ms is below what the bundled model's decodes take
# (overload most of the time: the liveness grants carry the prompts); the small pools force preemptions.
NEW_OPTIONS = [
    (dict(tbt_slo_ms=2.0, chunk_size=512), None),
    (dict(tbt_slo_ms=0.3, chunk_size=64, block_size=4, num_kv_blocks=40), None),
    (dict(chunk_size=16, max_partial_prefills=2, long_prefill_threshold=16), None),
    (
        dict(
            chunk_size=8,
            block_size=4,
            num_kv_blocks=40,
            max_partial_prefills=3,
            max_long_partial_prefills=2,
            long_prefill_threshold=8,
            scheduler="simple_chunking",
        ),
        None,
    ),
    (dict(chunk_size=16, block_size=4, num_kv_blocks=40), {"r0": 2, "r2": 1, "r3": -1, "r5": 1}),
    (
        dict(chunk_size=16, block_size=8, num_kv_blocks=30, tbt_slo_ms=1.0, max_partial_prefills=2),
        {"r1": 1, "r4": -2},
    ),
]


@pytest.mark.parametrize("options,priorities", NEW_OPTIONS)
def test_greedy_tokens_identical_under_the_scheduling_options(requests, reference, options, priorities):
    engine = LLMEngine(**options)
    finals = run(engine, requests, on_step=check_batch_shape, priorities=priorities)
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == reference
    if options.get("num_kv_blocks") == 40 and not options.get("tbt_slo_ms"):
        assert engine.scheduler.num_preemptions > 0, "the small pool should force preemptions"
    stops = {r.admission_stop for r in engine.step_records}
    assert stops <= {None, *ADMISSION_STOPS}
    if options.get("tbt_slo_ms") == 0.3:  # overloaded; admission stops unless one decode alone is over 0.3 ms
        slo = engine.stats()["tbt_slo"]
        assert slo["overloaded_steps"] > 0 and ("overload" in stops or slo["infeasible"])


def check_batch_shape(engine):
    """Sarathi: every decode of the step is in, within the budget; vllm: prefills never share with decodes."""
    record = engine.step_records[-1]
    policy = engine.config.scheduler
    if policy == "sarathi":
        assert record.num_prefill_tokens + record.num_decode_tokens <= engine.config.chunk_size
    if policy == "vllm":
        assert record.num_prefill_tokens == 0 or record.num_decode_tokens == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_sarathi_is_stall_free(requests, overlap):
    """Every sequence decoding before a step is in that step's batch (no decode waits behind a prefill); with
    overlap, all but those whose last token (by length) the step in flight samples."""
    engine = LLMEngine(scheduler="sarathi", chunk_size=16, block_size=4, num_kv_blocks=256, overlap=overlap)
    scheduler = engine.scheduler
    original = scheduler.schedule
    seen = []

    def schedule():
        decoding = [
            s for s in scheduler.running if not s.in_prefill and s.num_computed_tokens < s.max_kv_tokens
        ]
        out = original()
        has_prefill = any(s.in_prefill for s in out.scheduled)
        seen.append((decoding, dict(out.scheduled), has_prefill))
        return out

    scheduler.schedule = schedule
    run(engine, requests)
    assert any(decoding and has_prefill for decoding, _, has_prefill in seen), "no hybrid batch to check"
    for decoding, scheduled, _ in seen:
        assert all(scheduled.get(s) == 1 for s in decoding)
        assert sum(scheduled.values()) <= 16


def abort_when(state):
    def ready(seq):
        return {
            "waiting": seq.status.value == "waiting" and not seq.metrics.preemption_times,
            "mid-prefill": seq.status.value == "running"
            and 0 < seq.num_computed_tokens < seq.num_prefill_tokens,
            "decoding": seq.status.value == "running" and len(seq.output_token_ids) >= 2,
            "preempted": seq.status.value == "waiting" and bool(seq.metrics.preemption_times),
        }[state]

    return ready


@pytest.mark.parametrize("state", ["waiting", "mid-prefill", "decoding", "preempted"])
def test_abort_in_any_state_frees_blocks_and_stops_output(requests, reference, state):
    # a small pool and small chunks so that every state occurs; r0 is the victim
    engine = LLMEngine(scheduler="sarathi", chunk_size=8, block_size=4, num_kv_blocks=40, max_num_seqs=4)
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    victim_id = {"waiting": "r5", "preempted": None}.get(state, "r0")
    aborted = None
    reports = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        if aborted is None:
            candidates = [engine.requests[victim_id]] if victim_id else list(engine.requests.values())
            hit = [s for s in candidates if abort_when(state)(s)]
            if hit:
                aborted = hit[0]
                engine.abort_request(aborted.request_id)
                engine.abort_request(aborted.request_id)  # twice: a no-op
                engine.check_invariants()
                assert not aborted.block_table
                num_tokens = len(aborted.output_token_ids)
        for out in engine.step():
            reports.setdefault(out.request_id, []).append(out)
        engine.check_invariants()
    assert aborted is not None, f"never saw a request {state}"
    last = reports[aborted.request_id][-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert [o.finished for o in reports[aborted.request_id]].count(True) == 1
    assert len(last.outputs[0].token_ids) == num_tokens
    assert last.outputs[0].token_ids == reference[aborted.request_id][:num_tokens]
    for rid, outs in reports.items():  # the others are unaffected
        if rid != aborted.request_id:
            assert outs[-1].outputs[0].token_ids == reference[rid]
    assert_no_leaks(engine)


def test_bad_requests_are_rejected_alone(requests, reference):
    engine = LLMEngine(num_kv_blocks=10, block_size=16, max_model_len=256)
    rid, prompt, params = requests[0]
    engine.add_request(rid, prompt, params)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(rid, [1, 2], params)
    with pytest.raises(ValueError, match="KV blocks"):  # 120 + 100 tokens need 14 blocks of 16 > 10
        engine.add_request("big", prompt, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [1] * 257)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("vocab", [1, 512])
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("type", 3.5)
    with pytest.raises(ValueError, match="params"):
        engine.add_request("params", [1], {"max_tokens": 3})
    with pytest.raises(ValueError, match=r"priority must be in \[-2147483648, 2147483647\]"):
        engine.add_request("huge", [1], priority=10**400)  # would overflow the float queue key
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("low", [1], priority=-(2**31) - 1)
    with pytest.raises(ValueError, match="arrival_time"):
        engine.add_request("nan", [1], arrival_time=float("nan"))  # would break the sorted waiting queue
    ghost = engine.prepare_request("ghost", [1])
    ghost.priority = 10**400  # a queueing failure past validation must not leave the request registered
    with pytest.raises(OverflowError):
        engine.add_sequence(ghost)
    assert list(engine.requests) == [rid] and len(engine.scheduler.waiting) == 1
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == reference[rid]
    assert_no_leaks(engine)


def test_engine_options_are_checked():
    with pytest.raises(ValueError, match="chunk_sise"):
        LLMEngine(chunk_sise=8)
    with pytest.raises(ValueError, match="scheduler"):
        LLMEngine(scheduler="fifo")
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(max_model_len=513)
    block_bytes = 2 * 5 * 4 * 16 * 8 * 4  # K and V x 5 layers x 4 KV heads x 16 tokens x head_dim 8 x fp32
    engine = LLMEngine(block_size=16, kv_cache_bytes=5 * block_bytes + 1)
    assert engine.block_manager.num_blocks == 5 == engine.stats()["kv_blocks_total"]
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        LLMEngine(block_size=16, kv_cache_bytes=block_bytes - 1)


def test_default_kv_pool_follows_the_device(monkeypatch):
    block_bytes = 2 * 5 * 4 * 16 * 8 * 4
    usable = 128 * (512 // 16)  # max_num_seqs x the blocks of a max_model_len sequence
    assert (256 << 20) // block_bytes > usable  # the CPU default budget holds more than can ever be used ...
    assert LLMEngine(block_size=16).block_manager.num_blocks == usable  # ... so the pool is capped
    assert LLMEngine(block_size=16, max_num_seqs=4, max_model_len=100).block_manager.num_blocks == 4 * 7
    assert LLMEngine(block_size=16, num_kv_blocks=9000).block_manager.num_blocks == 9000  # explicit: as asked
    # A backend that reports its free device memory (the CUDA one) gets 90% of it; an explicit budget wins.
    from minisarathi.backends.cpu.ops import CpuOps

    monkeypatch.setattr(CpuOps, "free_memory_bytes", lambda self: 100 * block_bytes)
    assert LLMEngine(block_size=16).block_manager.num_blocks == 90
    assert LLMEngine(block_size=16, kv_cache_bytes=7 * block_bytes).block_manager.num_blocks == 7
    assert LLMEngine(block_size=16, num_kv_blocks=3).block_manager.num_blocks == 3
    monkeypatch.setattr(CpuOps, "free_memory_bytes", lambda self: None)  # no device memory to report
    assert LLMEngine(block_size=16, max_num_seqs=1024).block_manager.num_blocks == (256 << 20) // block_bytes


def generate(engine, prompt, params, rid="x"):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1]


def continuation(tokenizer, prompt_ids, output_ids):
    """The completion text rule (minisarathi/tokenizer.py): output_ids decoded as a continuation of the
    prompt."""
    return tokenizer.decode(prompt_ids + output_ids)[len(tokenizer.decode(prompt_ids)) :]


def test_generation_stops_at_max_model_len():
    engine = LLMEngine(max_model_len=20)
    out = generate(engine, [1] * 15, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    out = generate(engine, [1] * 20, SamplingParams(temperature=0, max_tokens=100), rid="full")
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids_stop_strings_and_min_tokens(reference, requests, blas_core):
    engine = LLMEngine()
    rid, prompt, _ = requests[0]
    tokens = reference[rid]
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    out = generate(
        engine, prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]), "a"
    )
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_id)
    full = generate(engine, prompt, SamplingParams(temperature=0, max_tokens=24), "b").outputs[0].text
    # the stop token's id is reported, its text is not (vLLM's rule)
    assert out.outputs[0].text == continuation(engine.tokenizer, prompt, tokens[:first])
    assert full.startswith(out.outputs[0].text) and len(full) > len(out.outputs[0].text)

    stop = full[10:14]
    out = generate(engine, prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), "c")
    assert out.outputs[0].text == full[: full.index(stop)]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)

    # min_tokens keeps a stop id from ending the request (the sampler masks it) until min_tokens are out
    out = generate(
        engine,
        prompt,
        SamplingParams(temperature=0, max_tokens=24, min_tokens=first + 1, stop_token_ids=[stop_id]),
        "d",
    )
    assert len(out.outputs[0].token_ids) > first + 1
    assert stop_id not in out.outputs[0].token_ids[: first + 1]

    # ... and a stop string too (vLLM's rule): one that ends within the first min_tokens tokens' text is text
    cut = next(
        n
        for n in range(1, 25)
        if stop in engine.tokenizer.decode(prompt + tokens[:n])[len(engine.tokenizer.decode(prompt)) :]
    )  # the token that completes the stop string
    out = generate(
        engine, prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop], min_tokens=cut), "e"
    )
    assert out.outputs[0].text.startswith(full[: full.index(stop) + len(stop)])
    assert len(out.outputs[0].token_ids) > cut
    later = full.find(stop, full.index(stop) + 1)
    assert out.outputs[0].finish_reason == ("stop" if later >= 0 else "length")


def test_eos_ends_a_request_unless_ignored():
    engine = LLMEngine()
    # The bundled model almost never emits its EOS (id 2), so declare its favourite first token to be EOS.
    first = (
        generate(engine, [1], SamplingParams(temperature=0, max_tokens=1), "probe").outputs[0].token_ids[0]
    )
    engine.tokenizer.eos_token_ids = (
        first,
    )  # what ends a request (the sampler's copy matters only for min_tokens)
    for skip_special_tokens in (True, False):
        out = generate(
            engine,
            [1],
            SamplingParams(temperature=0, max_tokens=5, skip_special_tokens=skip_special_tokens),
            "eos",
        )
        assert out.outputs[0].token_ids == [first] and out.outputs[0].text == ""  # EOS has no text
        assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)
    out = generate(engine, [1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), "ignore")
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_whatever_the_batch(requests, blas_core):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=1234, ignore_eos=True)
    alone = generate(LLMEngine(), "Tom had a red", params).outputs[0].token_ids
    # in a crowd, in small chunks, newest, in a pool small enough that it is preempted mid-decode
    engine = LLMEngine(chunk_size=8, block_size=4, num_kv_blocks=24)
    crowd = [
        (rid, p, SamplingParams(temperature=1.0, max_tokens=sp.max_tokens, ignore_eos=True))
        for rid, p, sp in requests[1:]
    ] + [("seeded", "Tom had a red", params)]
    finals = run(engine, crowd, stagger=6)
    assert finals["seeded"].outputs[0].token_ids == alone
    metrics = finals["seeded"].metrics
    assert metrics.preemption_times and metrics.preemption_times[-1] > metrics.first_token_time


def test_metrics_timeline_and_stats(requests):
    engine = LLMEngine(chunk_size=16, block_size=4, num_kv_blocks=40, enable_prefix_caching=True)
    finals = run(engine, requests)
    for rid, prompt, params in requests:
        m = finals[rid].metrics
        assert m.first_scheduled_time <= m.chunk_times[0][0] <= m.first_token_time <= m.finished_time
        assert m.arrival_time <= m.first_scheduled_time
        assert len(m.token_times) == params.max_tokens and m.token_times == sorted(m.token_times)
        prompt_len = len(finals[rid].prompt_token_ids)
        assert sum(n for _, n in m.chunk_times) >= prompt_len - finals[rid].num_cached_tokens
        assert m.token_times[0] == m.first_token_time
    stats = engine.stats()
    assert stats["tokens_generated"] == sum(sp.max_tokens for _, _, sp in requests)
    assert stats["steps"] == len(engine.step_records) > 0
    assert (stats["running"], stats["waiting"], stats["kv_blocks_used"]) == (0, 0, 0)
    assert 0 < stats["prefix_cache_hits"] <= stats["prefix_cache_queries"]
    assert sum(finals[r].num_cached_tokens for r in finals) > 0  # r1 and r4 share r0's prefix
    records = engine.step_records
    assert sum(r.num_prefill_tokens for r in records) + sum(r.num_decode_tokens for r in records) == sum(
        r.num_seqs and r.num_prefill_tokens + r.num_decode_tokens for r in records
    )
    assert all(
        r.schedule_time >= 0 and r.execution_time > 0 and r.step_time >= r.execution_time for r in records
    )


def test_logprobs_per_token(blas_core):
    engine = LLMEngine()
    out = generate(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    completion = out.outputs[0]
    assert len(completion.logprobs) == 6
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert entry[token].rank == 1  # greedy: the sampled token is the most likely
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        assert all(lp.logprob <= 0 and isinstance(lp.decoded_token, str) for lp in entry.values())
        probs = np.exp([lp.logprob for lp in entry.values()])
        assert probs.sum() <= 1 + 1e-6


def test_detokenize_false_and_final_only_outputs_keep_the_tokens(requests, reference):
    """detokenize=False: same tokens, no text; stream=False: one output per request, when it finishes."""
    engine = LLMEngine(chunk_size=16, block_size=4, num_kv_blocks=100)
    for rid, prompt, params in requests:
        quiet = SamplingParams(
            temperature=0,
            max_tokens=params.max_tokens,
            ignore_eos=True,
            detokenize=False,
            logprobs=1 if rid == "r0" else None,
        )
        engine.add_request(rid, prompt, quiet, stream=rid in ("r0", "r1"))
    reports = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            reports.setdefault(out.request_id, []).append(out)
        engine.check_invariants()
    assert_no_leaks(engine)
    for rid, outs in reports.items():
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == reference[rid]
        assert all(o.outputs[0].text == "" for o in outs)
        assert len(outs) == (len(reference[rid]) if rid in ("r0", "r1") else 1)
    assert all(
        lp.decoded_token is None for entry in reports["r0"][-1].outputs[0].logprobs for lp in entry.values()
    )
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_outputs_are_snapshots():
    """A streamed output never changes after step() returned it (the server reads them from another
    thread)."""
    engine = LLMEngine()
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0, max_tokens=8, logprobs=1))
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o, list(o.outputs[0].token_ids), len(o.outputs[0].logprobs)) for o in engine.step()]
    assert [len(ids) for _, ids, _ in seen] == list(range(1, 9))
    assert all(o.outputs[0].token_ids == ids and len(o.outputs[0].logprobs) == n for o, ids, n in seen)


def test_step_records_are_bounded_and_indexed_by_step(monkeypatch):
    monkeypatch.setattr(engine_module, "STEP_RECORDS_KEPT", 4)
    engine = LLMEngine()
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    mark = None
    while engine.has_unfinished_requests():
        engine.step()
        if len(engine.step_records) == 13:
            mark = len(engine.step_records)
    log = engine.step_records
    assert len(log) == engine.stats()["steps"] == 20  # one step per token (prompt in one chunk)
    assert 4 <= len(list(log)) < 8  # only the latest are kept
    assert [r.start_time for r in log[mark:]] == [r.start_time for r in list(log)[-7:]]
    assert log[-1] is list(log)[-1] and log[19] is log[-1]
    assert log[:3] == [] and log[:-1][-1] is list(log)[-2]
    with pytest.raises(IndexError):
        log[0]


@pytest.mark.parametrize("decodes_only", [False, True])
def test_build_batch_matches_a_per_token_reference(decodes_only):
    """The vectorized batch builder (make_batch, which the engine calls directly) against a plain loop."""
    rng = np.random.default_rng(decodes_only)
    for _ in range(50):
        block_size = int(rng.choice([1, 4, 16]))
        chunks, next_block = [], 0
        for _ in range(int(rng.integers(1, 6))):
            start, n = int(rng.integers(0, 40)), 1 if decodes_only else int(rng.integers(1, 20))
            num_blocks = -(-(start + n) // block_size) + int(rng.integers(0, 3))  # some spare blocks
            table = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            chunks.append(
                ScheduledChunk(rng.integers(0, 500, n).tolist(), start, table, bool(rng.integers(0, 2)))
            )
        batch = build_batch(chunks, block_size)
        ids, positions, slots, query_start, logits_rows = [], [], [], [0], []
        for c in chunks:
            for j, token in enumerate(c.token_ids):
                pos = c.start_pos + j
                ids.append(token)
                positions.append(pos)
                slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
            query_start.append(query_start[-1] + len(c.token_ids))
            if c.sample:
                logits_rows.append(query_start[-1] - 1)
        width = max(len(c.block_table) for c in chunks)
        tables = [c.block_table + [0] * (width - len(c.block_table)) for c in chunks]
        for name, want in [
            ("input_ids", ids),
            ("positions", positions),
            ("slot_mapping", slots),
            ("query_start", query_start),
            ("block_tables", tables),
            ("logits_indices", logits_rows),
            ("context_lens", [c.start_pos + len(c.token_ids) for c in chunks]),
        ]:
            got = getattr(batch, name)
            assert got.dtype == np.int32 and got.tolist() == want, name
        assert batch.max_query_len == max(len(c.token_ids) for c in chunks)
        assert batch.max_context_len == max(c.start_pos + len(c.token_ids) for c in chunks)


# the cost model and tbt_slo_ms under a fake clock
# ------------------------------------------------------------------

# seconds: per step, per prefill token, per decode, per unit of prefill attention, per unit of decode
# attention
FAKE_COSTS = np.array([2e-3, 0.2e-3, 0.5e-3, 2e-6, 5e-6])


class FakeClock:
    """Stands in for the `time` module of the engine and the profile: time passes only in the model's forward,
    by `costs` (the cost model's features) applied to the batch (a one-token row is a decode)."""

    def __init__(self, costs=FAKE_COSTS):
        self.now, self.costs = 1000.0, costs

    def monotonic(self):
        return self.now

    perf_counter = monotonic

    def charge(self, batch):
        q = np.diff(batch.query_start).astype(np.int64)
        start = batch.context_lens.astype(np.int64) - q
        decode = q == 1
        prefill_attention = (q * start + q * (q + 1) // 2)[~decode].sum()
        self.now += float(
            self.costs
            @ [1, q[~decode].sum(), decode.sum(), prefill_attention, batch.context_lens[decode].sum()]
        )


@pytest.fixture
def fake_clock(monkeypatch):
    from minisarathi.engine import profile as profile_module
    from minisarathi.model import llama

    clock = FakeClock()
    forward = llama.LlamaModel.forward

    def timed_forward(self, batch, kv_cache, device_logits=False):
        clock.charge(batch)
        return forward(self, batch, kv_cache, device_logits)

    monkeypatch.setattr(llama.LlamaModel, "forward", timed_forward)
    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(profile_module, "time", clock)
    return clock


def test_cost_model_recovers_the_step_costs_from_the_engines_own_records(fake_clock):
    """Whole prompts (no one-token prefill chunk, which the fake clock would count as a decode), one arriving
    every third step, then decodes of changing batch sizes and histories."""
    engine = LLMEngine(chunk_size=512, block_size=16, num_kv_blocks=64)
    assert engine.stats()["cost_model"]["coefficients"] is None  # no profile outside tbt_slo_ms mode
    prompts = [list(range(3, 3 + n)) for n in (30, 90, 7, 64, 45, 12)]
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=10 + 7 * i, ignore_eos=True)
        )
        for _ in range(3):
            engine.step()
    assert engine.cost_model.num_fits == 0  # outside tbt_slo_ms mode the steps only collect rows ...
    engine.stats()  # ... and reading the fit fits them
    while engine.has_unfinished_requests():
        engine.step()
    engine.cost_model.fit()
    np.testing.assert_allclose(engine.cost_model.coefficients, FAKE_COSTS, rtol=1e-6)
    summary = engine.stats()["cost_model"]
    assert summary["coefficients"]["decode_attention"] == pytest.approx(FAKE_COSTS[4])
    hist = summary["error_histogram"]  # once fitted, exact: every prediction within 5%
    assert hist["<=1.05"] == sum(hist.values()) > 0
    records = list(engine.step_records)
    assert all(r.predicted_time == pytest.approx(r.step_time) for r in records[-20:])


def test_slo_mode_keeps_steps_within_the_target(fake_clock, requests, reference):
    """With tbt_slo_ms = 10 and a chunk_size of 512, the 120-token prompt (~30 ms whole) is cut to what fits
    beside the decodes: every step stays within the target, the tokens are the reference ones."""
    engine = LLMEngine(chunk_size=512, block_size=16, num_kv_blocks=64, tbt_slo_ms=10)
    np.testing.assert_allclose(engine.cost_model.coefficients, FAKE_COSTS, rtol=1e-6)  # the start-up profile
    finals = run(engine, requests)
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == reference
    records = list(engine.step_records)
    assert max(r.step_time for r in records) <= 0.010
    limits = [r.time_limit for r in records]  # from target - 10%; no error beyond the margin: it only shrinks
    assert limits[0] == pytest.approx(0.009) and limits == sorted(limits) and limits[-1] < 0.0095
    # within the limit, or over it by the liveness grant (a block of 16 tokens for the first prompt
    # mid-prefill)
    assert all(r.predicted_time <= r.time_limit + 1e-12 or r.num_prefill_tokens <= 16 for r in records)
    assert max(r.num_prefill_tokens for r in records) < 120 and "budget" in {
        r.admission_stop for r in records
    }
    slo = engine.stats()["tbt_slo"]
    assert slo["overshoots"] == 0 and not slo["overloaded"] and slo["target_ms"] == 10


@pytest.mark.parametrize("num_blocks", [1024 // 4, 40])  # plenty; too few (paused KV must give way)
def test_paused_requests_get_no_tokens_keep_or_yield_their_kv_and_resume_exactly(
    requests, reference, num_blocks
):
    """The server pauses the requests of a client that stopped reading: they get no tokens and no batch slot,
    keep their KV blocks unless others need the memory (then they are preempted), and once resumed finish
    with the tokens they would have had anyway."""
    engine = LLMEngine(
        scheduler="sarathi", chunk_size=8, block_size=4, num_kv_blocks=num_blocks, max_num_seqs=3
    )
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    for _ in range(12):
        engine.step()
    paused = ["r0", "r1"]
    held = {
        rid: (len(engine.requests[rid].output_token_ids), list(engine.requests[rid].block_table))
        for rid in paused
    }
    for rid in paused:
        engine.pause_request(rid)
    engine.check_invariants()
    others_done = {}
    for _ in range(2000):
        if not engine.has_work():
            break
        for out in engine.step():
            assert out.request_id not in paused
            if out.finished:
                others_done[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
        # max_num_seqs counts only the scheduled: the paused ones' slots went to others
        assert len(engine.scheduler.running) <= 3
    assert others_done == {rid: reference[rid] for rid in reference if rid not in paused}
    for rid in paused:  # no token while paused; KV kept where nothing forced it out
        seq = engine.requests[rid]
        assert len(seq.output_token_ids) == held[rid][0]
        if num_blocks > 100:
            assert seq.block_table == held[rid][1]
    if num_blocks == 40:
        assert any(not engine.requests[rid].block_table for rid in paused), (
            "the small pool should preempt one"
        )
    assert engine.has_unfinished_requests() and not engine.has_work()
    for rid in paused:
        engine.resume_request(rid)
    finals = run(engine, [])
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == {
        rid: reference[rid] for rid in paused
    }


def test_pausing_an_n_choice_request_pauses_every_choice_and_others_go_on():
    """n > 1: pause_request stops all the request's choices (none keeps its batch slot), and the engine keeps
    stepping the other requests however many choices are paused."""
    engine = LLMEngine(scheduler="sarathi", chunk_size=16, block_size=4, num_kv_blocks=256, max_num_seqs=8)
    sampled = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("many", [1, 2, 3, 4], sampled)
    for _ in range(3):  # prefilled and forked into its choices
        engine.step()
    assert len(engine.requests["many"].choices) == 3
    held = [len(c.output_token_ids) for c in engine.requests["many"].choices]
    engine.pause_request("many")
    engine.add_request("other", [1, 5, 6], greedy)
    done = None
    for _ in range(100):
        assert engine.has_work(), "one request runs: the engine must keep stepping"
        for out in engine.step():
            assert out.request_id != "many"
            done = out if out.finished else done
        engine.check_invariants()
        if done is not None:
            break
    assert done is not None and len(done.outputs[0].token_ids) == 12
    assert [len(c.output_token_ids) for c in engine.requests["many"].choices] == held
    assert not engine.has_work() and engine.has_unfinished_requests()
    engine.resume_request("many")
    finals = run(engine, [])
    assert [len(c.token_ids) for c in finals["many"].outputs] == [40, 40, 40]


def test_a_slow_model_still_gets_a_determined_fit_from_the_profile(
    fake_clock, monkeypatch, requests, reference
):
    """A model too slow for the profile's time limit (issue 25: quantized on 2 cores, where the limit stopped
    the profile after 4 shapes, no fit, and the steps ran the fixed chunk_size budget of multi-second
    prefills): the cheap determining shapes still run, the fit is exact, the first step is held to the
    target. Tokens stay the reference ones."""
    from minisarathi.engine import profile as profile_module

    monkeypatch.setattr(profile_module, "PROFILE_SECONDS", 0.006)
    engine = LLMEngine(chunk_size=512, block_size=16, num_kv_blocks=64, tbt_slo_ms=10)
    np.testing.assert_allclose(engine.cost_model.coefficients, FAKE_COSTS, rtol=1e-6)
    assert len(engine.cost_model._anchor_rows) == profile_module.DETERMINING  # the limit stopped the rest
    finals = run(engine, requests)
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == reference
    records = list(engine.step_records)
    assert records[0].time_limit is not None and max(r.step_time for r in records) <= 0.010
