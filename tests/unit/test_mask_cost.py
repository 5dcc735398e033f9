"""The structured-output masks in the SLO cost model (engine/cost_model.py): measured per constrained row,
left out of the fit, and added to a step's predicted time where they lengthen it: all of it on the CPU,
only what the forward does not hide under overlap. So the tbt_slo_ms budget for prefill shrinks as
constrained decodes grow on the CPU, and not under overlap while the forward is the longer."""

import numpy as np
import pytest
from test_engine import FakeClock

from minisarathi.config import EngineConfig
from minisarathi.engine import engine as engine_module
from minisarathi.engine import profile as profile_module
from minisarathi.engine.block_manager import BlockManager
from minisarathi.engine.cost_model import CostModel, StepShape, step_shape
from minisarathi.engine.engine import LLMEngine
from minisarathi.engine.sequence import Sequence
from minisarathi.engine.slo_scheduler import make_scheduler
from minisarathi.outputs import RequestMetrics
from minisarathi.sampling_params import SamplingParams

# seconds: per step, per prefill token, per decode, per unit of prefill attention, per unit of decode
# attention
COSTS = np.array([2e-3, 1e-3, 0.5e-3, 1e-5, 2e-5])
MATCHER = object()  # the scheduler and the cost model only ask whether a sequence has one


def known_model(mask_per_row: float, overlapped: bool) -> CostModel:
    model = CostModel(overlapped=overlapped)
    model.coefficients = COSTS.copy()
    model.mask_per_row = mask_per_row
    return model


def prefill_grant(model: CostModel, constrained: int) -> int:
    """The tokens a 250-token prompt gets beside 8 running decodes, `constrained` of them under a grammar
    (target 40 ms: 36 ms to spend, the decodes' forward ~7 ms)."""
    scheduler = make_scheduler(
        EngineConfig(chunk_size=512, block_size=4, tbt_slo_ms=40), BlockManager(128, 4), 256, model
    )
    running = [
        Sequence(f"r{i}", None, [1] * 4, SamplingParams(max_tokens=8), RequestMetrics(0.0), 11, seq_id=i)
        for i in range(8)
    ]
    for seq in running:
        seq.matcher = MATCHER if seq.seq_id < constrained else None
        scheduler.add(seq)
    assert scheduler.schedule().scheduled == {seq: 4 for seq in running}
    for seq in running:  # their prompts computed, a token sampled: decodes from now on
        seq.num_computed_tokens = 4
        seq.output_token_ids.append(5)
    prompt = Sequence("p", None, [2] * 250, SamplingParams(max_tokens=2), RequestMetrics(0.0), 251, seq_id=8)
    scheduler.add(prompt)
    out = scheduler.schedule()
    assert all(out.scheduled[seq] == 1 for seq in running)
    return out.scheduled[prompt]


def shrinks(grants: list[int]) -> bool:
    return all(a > b for a, b in zip(grants, grants[1:]))


ROWS = [0, 2, 4, 8]


def test_the_prefill_budget_shrinks_as_constrained_rows_grow_on_the_cpu():
    grants = [prefill_grant(known_model(1e-3, overlapped=False), k) for k in ROWS]
    assert shrinks(grants), grants
    # a constrained row's 1 ms is about a prompt token's (1 ms and its attention): 8 rows take 6-8 tokens off
    assert 6 <= grants[0] - grants[-1] <= 8


def test_the_step_shape_counts_the_rows_that_sample_under_a_grammar():
    """A constrained decode is one row; a constrained prompt's last chunk one per choice (n > 1 forks then),
    its earlier chunks none; unconstrained rows none."""

    def seq(i, n=1, matcher=MATCHER, computed=0, prompt=8):
        params = SamplingParams(n=n, max_tokens=4)
        s = Sequence(f"s{i}", None, [1] * prompt, params, RequestMetrics(0.0), prompt + 3, matcher=matcher)
        s.num_computed_tokens, s.num_prefill_tokens = computed, prompt
        return s

    decode, free_decode = seq(0, computed=8), seq(1, matcher=None, computed=8)
    for s in (decode, free_decode):
        s.output_token_ids.append(5)
    ending, cut = seq(2, n=3, computed=4), seq(3, n=3)
    assert step_shape({decode: 1, free_decode: 1, ending: 4, cut: 4}).constrained == 1 + 3


def test_under_overlap_the_masks_hide_behind_a_longer_forward():
    """The 8 decodes' forward is ~7 ms: 8 masks of 0.5 ms hide behind it, and the grant stays; masks of 2 ms a
    row (16 ms) are longer than the forward, and only their excess (~9 ms) shrinks it."""
    hidden = [prefill_grant(known_model(0.5e-3, overlapped=True), k) for k in ROWS]
    assert len(set(hidden)) == 1
    cpu = [prefill_grant(known_model(2e-3, overlapped=False), k) for k in ROWS]
    exposed = [prefill_grant(known_model(2e-3, overlapped=True), k) for k in ROWS]
    assert exposed[0] == cpu[0] and cpu[-1] < exposed[-1] < exposed[0]


def test_negative_control_a_cost_model_that_ignores_the_masks_keeps_the_budget(monkeypatch):
    """The check above must fail where the masks are not priced."""
    monkeypatch.setattr(CostModel, "added_mask_time", lambda self, mask, forward: 0.0)
    grants = [prefill_grant(known_model(1e-3, overlapped=False), k) for k in ROWS]
    assert not shrinks(grants) and len(set(grants)) == 1


def synthetic_steps(rng, n: int):
    """Random step shapes, their forward's time by COSTS, and masks of 0.3 ms a constrained row."""
    for _ in range(n):
        decodes = int(rng.integers(1, 33))
        prefill = int(rng.integers(0, 200))
        shape = StepShape(
            prefill_tokens=prefill,
            decode_seqs=decodes,
            prefill_attention=prefill * int(rng.integers(1, 300)),
            decode_attention=decodes * int(rng.integers(1, 500)),
            constrained=int(rng.integers(0, decodes + 1)),
        )
        features = [1, prefill, decodes, shape.prefill_attention, shape.decode_attention]
        forward = float(COSTS @ features)
        yield shape, forward, 0.3e-3 * shape.constrained


def test_the_fit_leaves_the_masks_out_and_measures_them_per_row():
    """On the CPU a step is its forward plus its masks: the fit recovers the forward's coefficients, the
    model the mask time per row, and each prediction is the whole step. Fed no mask time (an engine that
    does not pass it), the fit takes the masks for decode cost."""
    model, blind = CostModel(), CostModel()
    for shape, forward, mask in synthetic_steps(np.random.default_rng(0), 200):
        model.add(shape, forward + mask, mask_seconds=mask)
        blind.add(shape, forward + mask)
    model.fit()
    blind.fit()
    np.testing.assert_allclose(model.coefficients, COSTS, rtol=1e-6)
    assert model.mask_per_row == pytest.approx(0.3e-3) and model.summary()["mask_seconds_per_row"] > 0
    shape = StepShape(decode_seqs=8, decode_attention=800, constrained=8)
    assert model.predict(shape) == pytest.approx(2e-3 + 8 * 0.5e-3 + 800 * 2e-5 + 8 * 0.3e-3)
    assert blind.coefficients[2] > 1.1 * COSTS[2] and blind.mask_per_row == 0  # the negative control


def test_overlapped_masks_shorter_than_the_forward_add_nothing():
    model = CostModel(overlapped=True)
    for shape, forward, mask in synthetic_steps(np.random.default_rng(1), 200):
        model.add(shape, forward, mask_seconds=mask)  # hidden: the step is its forward
    model.fit()
    np.testing.assert_allclose(model.coefficients, COSTS, rtol=1e-6)
    shape = StepShape(decode_seqs=8, decode_attention=800, constrained=8)
    assert model.predict(shape) == pytest.approx(2e-3 + 8 * 0.5e-3 + 800 * 2e-5)
    # masks of 10 ms against the 22 ms forward are hidden; of 40 ms, 18 ms show
    model.mask_per_row = 10e-3 / 8
    assert model.predict(shape) == pytest.approx(22e-3)
    model.mask_per_row = 40e-3 / 8
    assert model.predict(shape) == pytest.approx(40e-3)


MASK_COST = 0.7e-3


def test_the_engine_prices_its_masks(monkeypatch):
    """In tbt_slo_ms mode, under the fake clock: the model learns the mask time per row from the engine's
    own steps, and predicts each step whole, masks included (exactly, as the costs are exact)."""
    pytest.importorskip("llguidance", reason="structured outputs need the structured extra (llguidance)")
    from minisarathi import structured
    from minisarathi.model import llama

    clock = FakeClock(COSTS)  # the forward's time; the masks' is added below
    forward, mask_logits = llama.LlamaModel.forward, structured.mask_logits

    def timed_forward(self, batch, kv_cache, device_logits=False):
        clock.charge(batch)
        return forward(self, batch, kv_cache, device_logits)

    def timed_mask(sampler, logits, samplers):
        clock.now += MASK_COST * sum(seq.matcher is not None for seq in samplers)
        return mask_logits(sampler, logits, samplers)

    monkeypatch.setattr(llama.LlamaModel, "forward", timed_forward)
    monkeypatch.setattr(structured, "mask_logits", timed_mask)
    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(profile_module, "time", clock)
    engine = LLMEngine(chunk_size=512, block_size=16, num_kv_blocks=64, tbt_slo_ms=100)
    for i in range(6):
        structured_ = {"regex": "[a-z ]{4,12}"} if i % 2 else None
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, structured=structured_)
        engine.add_request(f"r{i}", [3 + i] * (5 + 4 * i), params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cost_model.mask_per_row == pytest.approx(MASK_COST)
    records = list(engine.step_records)
    constrained = [r for r in records if r.mask_time > 0]
    assert len(constrained) > 5
    # from the second constrained step on, the running average is exact: every prediction is the step
    assert all(r.predicted_time == pytest.approx(r.step_time, rel=1e-6) for r in constrained[1:])
