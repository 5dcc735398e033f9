"""Structured outputs under overlap (engine/overlap.py) on device="cuda-emulated": the tokens are those of the
synchronous engine, and the order of a step() call is the one that hides the mask behind the forward: step
N+1's forward issued, step N's ids waited for and consumed by the matchers, then step N+1's masks computed
on the host (while the device runs that forward), then its sampling issued; no wait on step N+1's own work
comes before its masks. A variant that issues the sampling before step N's update (its masks from stale
matchers) is the negative control the order check must catch."""

from __future__ import annotations

import platform

import pytest

pytest.importorskip("llguidance", reason="structured outputs need the structured extra (llguidance)")

from minisarathi import structured  # noqa: E402
from minisarathi.engine.engine import OverlappingEngine  # noqa: E402
from minisarathi.llm import LLM  # noqa: E402
from minisarathi.sampler import PendingSample  # noqa: E402
from minisarathi.sampling_params import SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"),
]

PROMPTS = ["Once upon a time", "Tom had a red", "The cat"]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, structured={"regex": "[a-z]{2,6}( [a-z]{2,6})*!"}),
    SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12, structured={"choice": ["a red ball", "tea"]}),
    SamplingParams(temperature=1.0, seed=5, max_tokens=8),  # unconstrained, in the same batches
]


def generate(overlap: bool) -> tuple[list, LLM]:
    llm = LLM(chunk_size=8, block_size=4, num_kv_blocks=64, device="cuda-emulated", overlap=overlap)
    assert llm.engine.overlap is overlap
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, PARAMS)], llm


@pytest.fixture(scope="module")
def overlapped():
    return generate(True)


def test_overlap_gives_the_tokens_of_the_synchronous_engine(overlapped):
    tokens, _ = overlapped
    assert tokens == generate(False)[0]
    assert all(tokens[0]) and all(tokens[1]) and all(tokens[2])


def record(engine, monkeypatch) -> list[tuple]:
    """The events of the engine's steps, in order: ("forward", k) as step k's forward is issued, ("sample", k)
    and ("wait", k) as its sampling is issued and its ids waited for, ("consume", matcher) as a matcher takes
    a sampled token, ("mask", matchers) as masks are computed, ("to_host",) for a download (a wait on
    everything queued, the forward included)."""
    events, forwards, launches = [], [0], [0]
    forward, launch, to_host = engine._forward, engine.sampler.launch, engine.model.ops.launcher.to_host
    finished, compute_bitmask = structured.finished, structured.compute_bitmask

    def recorded_forward(batch):
        forwards[0] += 1
        events.append(("forward", forwards[0]))
        return forward(batch)

    def recorded_launch(*args):
        launches[0] += 1
        k = forwards[0]  # the step whose forward was issued last is the one sampling
        events.append(("sample", k))
        pending = launch(*args)

        def result():
            events.append(("wait", k))
            return pending.result()

        return PendingSample(pending.token_ids, result)

    def recorded_finished(matcher, token):
        events.append(("consume", matcher))
        return finished(matcher, token)

    def recorded_bitmask(matchers, vocab_size):
        events.append(("mask", tuple(matchers)))
        return compute_bitmask(matchers, vocab_size)

    def recorded_to_host(array):
        events.append(("to_host",))
        return to_host(array)

    monkeypatch.setattr(engine, "_forward", recorded_forward)
    monkeypatch.setattr(engine.sampler, "launch", recorded_launch)
    monkeypatch.setattr(engine.model.ops.launcher, "to_host", recorded_to_host)
    monkeypatch.setattr(structured, "finished", recorded_finished)
    monkeypatch.setattr(structured, "compute_bitmask", recorded_bitmask)
    return events


def order_violations(events: list[tuple]) -> list[str]:
    """Each masks event of step k must come after step k's forward was issued and before its sampling, with
    no download nor wait on step k's work in between; and each matcher it masks must have consumed the token
    of every earlier mask of it (so step k - 1's too: its ids were waited for)."""
    violations, masks, consumes = [], {}, {}
    last_forward = 0
    for i, event in enumerate(events):
        if event[0] == "forward":
            last_forward = i
        elif event[0] == "consume":
            consumes[event[1]] = consumes.get(event[1], 0) + 1
        elif event[0] == "mask":
            k = events[last_forward][1]
            if next(e for e in events[i:] if e[0] == "sample") != ("sample", k):
                violations.append(f"the masks of step {k} came after its sampling was issued")
            if any(e[0] == "to_host" or e == ("wait", k) for e in events[last_forward:i]):
                violations.append(f"the masks of step {k} waited on its forward")
            for matcher in event[1]:
                if consumes.get(matcher, 0) != masks.get(matcher, 0):
                    violations.append(f"the masks of step {k} used a matcher before its previous token")
                masks[matcher] = masks.get(matcher, 0) + 1
    return violations


def test_the_masks_are_computed_while_the_forward_runs(overlapped, monkeypatch):
    engine = overlapped[1].engine
    events = record(engine, monkeypatch)
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"o{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert order_violations(events) == []
    masked = [m for e in events if e[0] == "mask" for m in e[1]]
    assert len(set(masked)) == 3 and len(masked) > 10  # the regex row, and the choice's two matchers


def test_negative_control_sampling_issued_before_the_previous_update(overlapped, monkeypatch):
    """Step N+1's sampling issued right after its forward, before step N's tokens reach the matchers: the
    masks are computed from matchers one token behind, which the order check must catch."""

    def sample_first(self, start):
        launched = self._launch(start)
        previous, self._in_flight, self._in_flight_rows = self._in_flight, None, {}
        if launched is not None:
            self._sample(launched)
        ids_wait, outputs = (0.0, []) if previous is None else self._complete(previous)
        if launched is not None:
            self._in_flight = launched
            self._in_flight_rows = {seq: row for row, seq in enumerate(launched.samplers)}
            self._record(launched, start, ids_wait)
        return outputs

    engine = overlapped[1].engine
    monkeypatch.setattr(OverlappingEngine, "_run_step", sample_first)
    events = record(engine, monkeypatch)
    engine.add_request("bad", PROMPTS[0], PARAMS[0])
    for _ in range(10):
        engine.step()
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    engine.step()
    engine.step()
    assert any("before its previous token" in v for v in order_violations(events))
