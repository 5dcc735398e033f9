"""Speculative decoding (engine/speculative.py): the n-gram proposer, greedy outputs token-identical to plain
decoding over policies / k / chunk sizes / preemption / prefix caching / n > 1 with block invariants every
step, the budget, rejection sampling's distribution, the config's errors."""

import numpy as np
import pytest

from minisarathi.config import EngineConfig
from minisarathi.engine import speculative
from minisarathi.engine.engine import LLMEngine, SpeculativeEngine
from minisarathi.engine.speculative import accepted_length, propose
from minisarathi.sampler import Sampler
from minisarathi.sampling_params import SamplingParams

REPETITIVE = "Tom had a red ball. Tom had a red ball. He liked to"
PROMPTS = [REPETITIVE, "Once upon a time", "Lily and Tom went to the park. Lily and Tom"]
CHI2_CRIT_001 = {4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # chi-square at p = 0.001 by degrees of freedom


def ngram(k, high=3, low=1):
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": high,
        "prompt_lookup_min": low,
    }


def run(engine, requests, check=True):
    """Every request's (token ids, text, logprobs) of choice 0..n-1, invariants checked after every step."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [(c.token_ids, c.text, c.logprobs) for c in out.outputs]
        if check:
            engine.check_invariants()
    assert all(r == 0 for r in engine.block_manager.ref_counts), "a block leaked"
    return finals


def greedy(max_tokens=40, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference():
    """Plain decoding, one request at a time."""
    engine = LLMEngine()
    return {p: run(engine, [("r", p, greedy())])["r"][0][0] for p in PROMPTS}


def test_propose_takes_the_latest_longest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 3, 1) == [7, 5]  # latest 3-gram occurrence
    assert propose([4, 2, 3, 9, 1, 2, 3], 3, 3, 1) == [9, 1, 2]  # the 2-gram [2, 3] when no 3-gram occurs
    assert propose([1, 2, 3, 4], 2, 3, 1) == []  # nothing repeats
    assert propose([5, 6, 5, 6], 4, 3, 2) == [5, 6]  # what follows may be the suffix itself
    assert propose([5, 6, 5, 6], 0, 3, 1) == []
    # a byte-level match across token boundaries is no match: 256 = bytes 00 01 00 00, 1 = 01 00 00 00
    assert propose([7, 256, 0, 3, 1, 0], 1, 1, 1) == [3]  # the 0 after 256, not a misaligned hit


def test_config_errors_are_clear():
    for bad, message in [
        ([], "must be a dict"),
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2}, "not supported yet"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"num_speculative_tokens": 2, "n": 1}, "unknown key"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="overlap off"):
        EngineConfig(speculative_config=ngram(2), overlap=True)
    config = EngineConfig(speculative_config={"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.speculative_config.prompt_lookup_min, config.speculative_config.prompt_lookup_max) == (
        4,
        4,
    )


@pytest.mark.parametrize(
    "options",
    [
        dict(scheduler="sarathi", chunk_size=16, speculative_config=ngram(4)),
        dict(scheduler="sarathi", chunk_size=512, block_size=8, speculative_config=ngram(1)),
        dict(scheduler="vllm", speculative_config=ngram(3, high=2)),
        dict(scheduler="orca", block_size=4, speculative_config=ngram(4)),
        dict(scheduler="simple_chunking", chunk_size=8, speculative_config=ngram(2)),
        # a pool small enough to preempt (asserted), prefix caching on
        dict(num_kv_blocks=14, block_size=8, enable_prefix_caching=True, speculative_config=ngram(4)),
        dict(tbt_slo_ms=50, chunk_size=64, speculative_config=ngram(4)),
    ],
)
def test_greedy_output_is_token_identical(options, reference):
    engine = LLMEngine(**options)
    assert isinstance(engine, SpeculativeEngine)
    finals = run(engine, [(p, p, greedy()) for p in PROMPTS])
    assert {p: finals[p][0][0] for p in PROMPTS} == reference
    stats = engine.stats()["spec_decode"]
    assert stats["num_draft_tokens"] >= stats["num_accepted_tokens"]
    # with tbt_slo_ms the drafts depend on the machine's timing (the cost model, the margin): maybe none
    assert stats["num_accepted_tokens"] > 0 or "tbt_slo_ms" in options
    if "num_kv_blocks" in options:
        assert engine.stats()["num_preemptions"] > 0


def test_a_wrong_acceptance_rule_fails_the_identity(monkeypatch, reference):
    """Negative control: accepting the first draft whatever the model sampled changes the output."""
    monkeypatch.setattr(
        speculative, "accepted_length", lambda sampled, draft: max(1, accepted_length(sampled, draft))
    )
    finals = run(LLMEngine(speculative_config=ngram(4)), [(p, p, greedy()) for p in PROMPTS])
    assert {p: finals[p][0][0] for p in PROMPTS} != reference


def test_stop_strings_min_tokens_logprobs_and_n():
    """Against plain decoding of the same requests: a stop string met mid-acceptance, min_tokens with EOS
    masked, logprobs of the accepted tokens, greedy n = 2."""
    requests = [
        ("stop", REPETITIVE, greedy(60, stop=["Tom saw"])),
        ("eos", "Once upon a time", SamplingParams(temperature=0, max_tokens=60, min_tokens=30)),
        ("lp", REPETITIVE, greedy(24, logprobs=2)),
        ("n2", REPETITIVE, greedy(24, n=2)),
        ("pen", REPETITIVE, greedy(24, repetition_penalty=1.3)),
    ]
    plain = run(LLMEngine(), requests)
    spec_engine = LLMEngine(speculative_config=ngram(4), chunk_size=32)
    spec = run(spec_engine, requests)
    assert spec_engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
    for rid in ("stop", "eos", "n2", "pen"):
        assert [c[:2] for c in spec[rid]] == [c[:2] for c in plain[rid]], rid
    assert len(plain["stop"][0][0]) < 60  # the stop string ended it
    (tokens, text, logprobs), (plain_tokens, plain_text, plain_logprobs) = spec["lp"][0], plain["lp"][0]
    assert tokens == plain_tokens and text == plain_text
    for got, want in zip(logprobs, plain_logprobs):
        assert got.keys() == want.keys()
        for t in want:
            assert got[t].rank == want[t].rank and got[t].decoded_token == want[t].decoded_token
            assert abs(got[t].logprob - want[t].logprob) < 1e-4


def test_speculation_stays_within_the_budget():
    """The drafts come from what the step leaves: no step over chunk_size, none at all when the decodes
    fill it."""
    engine = LLMEngine(speculative_config=ngram(4), chunk_size=6)
    run(engine, [(f"r{i}", REPETITIVE, greedy(30)) for i in range(3)])
    records = engine.step_records[0:]
    assert all(r.num_prefill_tokens + r.num_decode_tokens <= 6 for r in records)
    assert engine.stats()["spec_decode"]["num_drafts"] > 0
    full = LLMEngine(speculative_config=ngram(4), chunk_size=4)
    run(full, [(f"r{i}", "Tom had", greedy(24)) for i in range(4)])
    full_steps = [r for r in full.step_records[0:] if r.num_seqs == 4]
    assert full_steps and all(r.num_prefill_tokens + r.num_decode_tokens == 4 for r in full_steps)


def test_rejection_sampling_keeps_the_distribution():
    """Row 0 samples position 0; row 1 position 1 after the draft. The first emitted token must follow p0 and,
    when it is the draft, the second p1: chi-square against the sampler's processed distributions."""
    vocab, n, draft = 8, 20000, 2
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(2, vocab)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=6)
    sampler = Sampler(vocab, seed=11)
    x = np.tile(logits, (n, 1))  # float32[2n, V]: (row 0, row 1) n times
    ids = sampler.sample(x, [params] * 2 * n, [None] * 2 * n, [[1]] * 2 * n, [[]] * 2 * n).token_ids
    ids = ids.reshape(n, 2)
    first = ids[:, 0]
    kept = np.array([accepted_length(row.tolist(), [draft]) for row in ids]) == 1
    assert (kept == (first == draft)).all()

    def probs(row):  # the sampler's processing: temperature, then top-k
        z = logits[row] / params.temperature
        z[np.argsort(z)[: vocab - params.top_k]] = -np.inf
        p = np.exp(z - z.max())
        return p / p.sum()

    for drawn, p in ((first, probs(0)), (ids[kept, 1], probs(1))):
        counts, expected = np.bincount(drawn, minlength=vocab), p * len(drawn)
        support = expected > 0
        assert counts[~support].sum() == 0
        chi2 = (((counts - expected) ** 2)[support] / expected[support]).sum()
        assert chi2 < CHI2_CRIT_001[support.sum() - 1]
    assert 0.05 < kept.mean() < 0.95  # both outcomes were exercised


def test_sampling_runs_with_invariants():
    """Seeded sampling with n > 1 and prefix caching: runs to the end, blocks consistent every step."""
    engine = LLMEngine(speculative_config=ngram(4), enable_prefix_caching=True, block_size=4)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=40, n=2, seed=3, ignore_eos=True)
    finals = run(engine, [("a", REPETITIVE, params), ("b", REPETITIVE, params)])
    assert all(len(c[0]) == 40 for c in finals["a"] + finals["b"])
    assert engine.stats()["spec_decode"]["num_drafts"] > 0


def test_counters_reach_metrics_under_vllms_names():
    prometheus = pytest.importorskip("prometheus_client.parser")
    from minisarathi.server.metrics import Metrics

    engine = LLMEngine(speculative_config=ngram(4))
    run(engine, [("r", REPETITIVE, greedy(24))])
    metrics = Metrics("m", max_model_len=512, token_budget=512)
    metrics.read_engine(engine)
    text = metrics.exposition().decode()
    values = {s.name: s.value for f in prometheus.text_string_to_metric_families(text) for s in f.samples}
    stats = engine.stats()["spec_decode"]
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert values[f"minisarathi:spec_decode_{name}_total"] == stats[name] > 0
    assert stats["mean_acceptance_length"] == 1 + stats["num_accepted_tokens"] / stats["num_drafts"]
    plain = Metrics("m", max_model_len=512, token_budget=512)
    plain.read_engine(LLMEngine())  # no speculation: no spec_decode series
    assert "spec_decode" not in plain.exposition().decode()


def test_constrained_rows_do_not_speculate():
    """Structured outputs: a constrained row never takes drafts (its mask would need the drafts consumed);
    the unconstrained request beside it does, and keeps its plain tokens."""
    pytest.importorskip("llguidance")
    engine = LLMEngine(speculative_config=ngram(4))
    constrained = greedy(24, structured={"regex": "(ab)+"})
    seen = []
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        seen.extend(seq.request_id for seq in engine.scheduler.drafts)
        return out

    engine.scheduler.schedule = schedule
    finals = run(engine, [("c", REPETITIVE, constrained), ("u", REPETITIVE, greedy())])
    assert "c" not in seen and "u" in seen
    assert finals["u"][0][0] == run(LLMEngine(), [("u", REPETITIVE, greedy())])["u"][0][0]


@pytest.mark.system
def test_greedy_identity_on_the_cuda_emulator():
    """The verification chunk on the CUDA backend's kernels (the prefill path), emulated: plain tokens."""
    options = dict(device="cuda-emulated", chunk_size=16, block_size=4, cuda_graphs=False, max_num_seqs=4)
    requests = [(p, p, greedy(16)) for p in PROMPTS[:2]]
    plain = run(LLMEngine(**options), requests)
    engine = LLMEngine(**options, speculative_config=ngram(3))
    spec = run(engine, requests)
    assert {p: spec[p][0][0] for p in PROMPTS[:2]} == {p: plain[p][0][0] for p in PROMPTS[:2]}
    assert engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
