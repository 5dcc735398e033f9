"""Overlap of the host with the device (engine/overlap.py): a step launched before the previous one's ids are
on the host must change nothing a client sees. Every test runs the same requests with overlap off and on and
wants the same tokens, texts, finish reasons and logprobs, no token streamed twice or lost, and the KV pool
free at the end."""

import argparse

import pytest

from minisarathi.cli_args import add_engine_arguments, engine_options_from_args
from minisarathi.config import EngineConfig
from minisarathi.engine.engine import LLMEngine
from minisarathi.paths import default_model_dir
from minisarathi.sampling_params import SamplingParams
from minisarathi.tokenizer import Tokenizer

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high."
)


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_pretrained(default_model_dir())
    story = tok.encode(STORY)
    return [
        story[:60],
        story[:25] + tok.encode("Tom had a red")[1:],
        story[:3],
        "Lily and Tom went to the park.",
        story[:40],
        [1],
    ]


@pytest.fixture(scope="module")
def greedy_tokens(prompts):
    """Each prompt's greedy continuation (overlap off), to pick stop ids and strings that fire mid-stream."""
    engine = LLMEngine(overlap=False)
    outs = drive(
        engine,
        [
            (f"g{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
            for i, p in enumerate(prompts)
        ],
    )[0]
    return [outs[f"g{i}"].outputs[0] for i in range(len(prompts))]


def mixed_requests(prompts, greedy_tokens):
    """Stops of every kind firing mid-stream (so overlap wastes rows: greedy and seeded, a stop id, a stop
    string, a stop id held back by min_tokens), seeded sampling with penalties and logit_bias, n > 1 whose
    choices end differently, logprobs, and greedy requests ending by length."""
    g = greedy_tokens
    seeded = dict(temperature=0.9, top_k=40, top_p=0.9, seed=7)
    params = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[g[0].token_ids[6]]),
        SamplingParams(temperature=0, max_tokens=20, stop=[g[1].text[8:12]], logprobs=3),
        SamplingParams(max_tokens=12, n=3, stop_token_ids=list(range(300, 330)), **seeded),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(
            max_tokens=16,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            logit_bias={5: 3.0},
            logprobs=2,
            stop_token_ids=list(range(250, 270)),
            **seeded,
        ),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=4, stop_token_ids=[g[5].token_ids[2]]),
    ]
    return [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]


def drive(engine, requests, stagger=3, abort=None, pause=None):
    """Run requests to the end, the last ones added after two steps; check the invariants every step and that
    streams only grow. abort: (request id, k): abort it once its stream shows k tokens. pause: (request id,
    k): pause it once its stream shows k tokens and resume it two steps later. Returns the final outputs by id
    and the streams' last snapshots."""
    finals, streamed = {}, {}
    late, resume_at = requests[stagger:], None
    for rid, prompt, params in requests[:stagger]:
        engine.add_request(rid, prompt, params)
    for num_steps in range(3000):
        if not (engine.has_unfinished_requests() or late):
            break
        if num_steps == 2:
            for rid, prompt, params in late:
                engine.add_request(rid, prompt, params)
            late = []
        if resume_at == num_steps:
            engine.resume_request(pause[0])
        for out in engine.step():
            assert out.request_id not in finals, "a finished request reported again"
            for completion in out.outputs:
                before = streamed.get((out.request_id, completion.index))
                if before is not None:  # cumulative and never retracted
                    assert completion.token_ids[: len(before)] == before
                streamed[(out.request_id, completion.index)] = completion.token_ids
            if out.finished:
                finals[out.request_id] = out
        engine.check_invariants()
        if abort and len(streamed.get((abort[0], 0), ())) >= abort[1] and abort[0] not in finals:
            engine.abort_request(abort[0])
            abort = (abort[0], 1 << 30)
        if pause and resume_at is None and len(streamed.get((pause[0], 0), ())) >= pause[1]:
            engine.pause_request(pause[0])
            resume_at = num_steps + 3
    else:
        raise AssertionError("no progress")
    blocks = engine.block_manager
    assert all(r == 0 for r in blocks.ref_counts) and blocks.num_free_blocks == blocks.num_blocks
    return finals, streamed


def assert_same_outputs(off, on):
    assert off.keys() == on.keys()
    for rid in off:
        for a, b in zip(off[rid].outputs, on[rid].outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
                b.token_ids,
                b.text,
                b.finish_reason,
                b.stop_reason,
            ), rid
            assert (a.logprobs is None) == (b.logprobs is None)
            for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert x.keys() == y.keys()
                for t in x:  # the same logits up to the rounding of a different batch mix
                    assert (
                        x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5)
                        and x[t].decoded_token == y[t].decoded_token
                    )


def both_ways(requests, **options):
    """(outputs with overlap off, with overlap on, engines) for the same requests."""
    engines = [LLMEngine(overlap=False, **options), LLMEngine(overlap=True, **options)]
    (off, _), (on, _) = (drive(engine, requests) for engine in engines)
    assert_same_outputs(off, on)
    return off, on, engines


# small chunks and blocks: prefill chunks mix with decodes in every step
HYBRID = dict(scheduler="sarathi", chunk_size=16, block_size=4)


def test_every_stop_kind_sampling_option_and_fork_gives_the_same_outputs(prompts, greedy_tokens):
    requests = mixed_requests(prompts, greedy_tokens)
    off, on, engines = both_ways(requests, num_kv_blocks=256, **HYBRID)
    reasons = {rid: [c.finish_reason for c in out.outputs] for rid, out in off.items()}
    assert reasons["r0"] == reasons["r1"] == reasons["r4"] == reasons["r5"] == ["stop"]
    assert reasons["r3"] == ["length"] and sorted(set(reasons["r2"])) == ["length", "stop"]  # n = 3
    r5 = off["r5"].outputs[0].token_ids
    assert len(r5) > 4 and greedy_tokens[5].token_ids[2] not in r5[:4]  # min_tokens held the stop id back
    decodes = [sum(r.num_decode_tokens for r in e.step_records) for e in engines]
    assert decodes[1] > decodes[0], "no request stopped by a token while the next step was in flight"


def test_a_wasted_row_draws_no_random_number(prompts):
    """Unseeded requests draw from the engine's one generator, in row order: a row wasted on a request that
    stopped would shift every later draw. All admitted in the first step and nothing else binding, the
    batches are the same both ways, so the draws, and the tokens, must be too."""
    unseeded = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    requests = [
        ("early", prompts[3], SamplingParams(stop_token_ids=list(range(320, 340)), **unseeded)),
        ("a", prompts[2], SamplingParams(**unseeded)),
        ("b", prompts[5], SamplingParams(**unseeded)),
    ]
    off, _, _ = both_ways(requests, num_kv_blocks=256, chunk_size=512, block_size=4)
    assert off["early"].outputs[0].finish_reason == "stop" and 1 < len(off["early"].outputs[0].token_ids) < 11


def test_preemption_in_a_tiny_pool_gives_the_same_outputs(prompts, greedy_tokens):
    requests = mixed_requests(prompts, greedy_tokens)
    _, _, engines = both_ways(requests, num_kv_blocks=22, **HYBRID)
    assert all(e.scheduler.num_preemptions > 0 for e in engines)


def test_a_request_ending_by_length_wastes_no_row(prompts):
    """The host knows which token is a request's last by length: no step is launched after it, so a request
    that needs the whole pool never has to preempt itself for a row it would waste, nor reach past
    max_model_len."""
    requests = [
        ("a", prompts[0][:15], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
        ("b", prompts[0][:15], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)),
    ]
    for request in requests:  # 20 tokens: 19 in the cache, 5 blocks of 4, all the pool has
        _, _, engines = both_ways([request], num_kv_blocks=5, max_model_len=20, **HYBRID)
        assert [e.scheduler.num_preemptions for e in engines] == [0, 0]
        assert len({sum(r.num_decode_tokens for r in e.step_records) for e in engines}) == 1


@pytest.mark.parametrize("scheduler", ["vllm", "orca", "simple_chunking", "faster_transformer"])
def test_other_policies_and_prefix_caching_give_the_same_outputs(prompts, greedy_tokens, scheduler):
    both_ways(
        mixed_requests(prompts, greedy_tokens),
        scheduler=scheduler,
        chunk_size=16,
        block_size=4,
        num_kv_blocks=256,
        enable_prefix_caching=True,
    )


@pytest.mark.parametrize("num_kv_blocks", [256, 22])
def test_abort_and_pause_mid_stream(prompts, greedy_tokens, num_kv_blocks):
    """An abort after the client saw k tokens reports exactly those k (the token in flight is dropped); a
    request paused and resumed mid-stream (in the tiny pool, preempted while paused) goes on exactly."""
    requests = mixed_requests(prompts, greedy_tokens)
    results = []
    for overlap in (False, True):
        engine = LLMEngine(overlap=overlap, num_kv_blocks=num_kv_blocks, **HYBRID)
        finals, streamed = drive(engine, requests, abort=("r3", 3), pause=("r4", 4))
        assert finals["r3"].outputs[0].finish_reason == "abort"
        assert len(finals["r3"].outputs[0].token_ids) == 3
        results.append(finals)
    assert_same_outputs(*results)


@pytest.mark.parametrize("num_kv_blocks", [256, 22])
def test_a_request_paused_while_its_last_token_is_in_flight_finishes(prompts, greedy_tokens, num_kv_blocks):
    """r3 (7 tokens) paused once the client saw 6: with overlap its 7th, its last, is in flight then, and it
    finishes paused (it leaves the paused queue and frees its blocks); without, it finishes once resumed."""
    requests = mixed_requests(prompts, greedy_tokens)
    results = []
    for overlap in (False, True):
        engine = LLMEngine(overlap=overlap, num_kv_blocks=num_kv_blocks, **HYBRID)
        finals, _ = drive(engine, requests, pause=("r3", 6))
        assert finals["r3"].outputs[0].finish_reason == "length" and not engine.scheduler.paused
        results.append(finals)
    assert_same_outputs(*results)


def test_a_request_preempted_while_its_last_token_is_in_flight_finishes():
    """A 4-block pool: when "a" needs a block, "b" (the latest) is preempted by the scheduling of the step
    after the one sampling b's last token; with overlap that token arrives after the preemption, and b
    finishes in the waiting queue (it leaves it, holding no block)."""
    requests = [
        ("a", [1, 5, 6, 7], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
        ("b", [1, 8, 9], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
    ]
    _, on, engines = both_ways(requests, num_kv_blocks=4, **HYBRID)
    assert on["b"].outputs[0].finish_reason == "length" and on["b"].metrics.preemption_times
    assert not engines[1].scheduler.waiting


def test_emulated_cuda_kernels_give_the_same_outputs(prompts, greedy_tokens):
    """The CUDA backend's path (the next forward takes the ids on the device, the sampler's ids and logprobs
    come back after) on the emulator: few, short requests."""
    g = greedy_tokens
    requests = [
        (
            "a",
            prompts[0][:12],
            SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[g[0].token_ids[2]]),
        ),
        ("b", prompts[3], SamplingParams(max_tokens=5, n=2, temperature=0.9, seed=3, logprobs=2)),
        ("c", prompts[5], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
    ]
    _, _, engines = both_ways(requests, device="cuda-emulated", num_kv_blocks=32, **HYBRID)
    assert engines[1].model.ops.device == "cuda-emulated"


def test_the_step_log_splits_host_time_from_the_wait_for_ids(prompts):
    for overlap in (False, True):
        engine = LLMEngine(overlap=overlap, **HYBRID)
        drive(engine, [("a", prompts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))])
        records = list(engine.step_records)
        assert records and all(r.host_time >= 0 and r.ids_wait_time >= 0 for r in records)
        assert all(r.host_time + r.ids_wait_time == pytest.approx(r.step_time, abs=1e-9) for r in records)
        assert all(r.execution_time >= r.ids_wait_time for r in records)


def test_overlap_defaults_and_switch():
    assert LLMEngine().overlap is False  # the CPU backend computes while it issues
    assert LLMEngine(device="cuda-emulated").overlap is False  # so does the emulator
    assert LLMEngine(overlap=True).overlap is True
    with pytest.raises(ValueError, match="overlap needs tensor_parallel_size 1"):
        EngineConfig(overlap=True, tensor_parallel_size=2)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_options_from_args(parser.parse_args([]))["overlap"] is None
    assert engine_options_from_args(parser.parse_args(["--no-overlap"]))["overlap"] is False
