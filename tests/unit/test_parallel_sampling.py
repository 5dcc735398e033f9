"""n > 1: the choices of a request share its prompt's KV blocks (computed once; a shared partial block is
copied when a choice first writes into it), and each choice samples exactly as a separate request seeded
with seed + index would."""

import numpy as np
import pytest

from minisarathi.engine.engine import LLMEngine
from minisarathi.llm import LLM
from minisarathi.sampling_params import SamplingParams

PROMPTS = ["Once upon a time", "Tom had a red", "Lily and Tom went to the park. They saw"]


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]):
    """Step to the end, checking the block manager after every step; the finished outputs by id."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    return finished


@pytest.mark.parametrize("block_size", [4, 5, 16])
def test_each_choice_samples_as_a_request_seeded_with_seed_plus_index(block_size):
    options = dict(chunk_size=8, block_size=block_size, num_kv_blocks=128)
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=11, max_tokens=14, logprobs=2)
    together = run(LLMEngine(**options), {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)})
    alone = run(
        LLMEngine(**options),
        {
            f"r{i}-{k}": (
                p,
                SamplingParams(temperature=1.0, top_p=0.9, seed=11 + k, max_tokens=14, logprobs=2),
            )
            for i, p in enumerate(PROMPTS)
            for k in range(3)
        },
    )
    for i in range(len(PROMPTS)):
        outputs = together[f"r{i}"].outputs
        assert [c.index for c in outputs] == [0, 1, 2]
        for k, choice in enumerate(outputs):
            want = alone[f"r{i}-{k}"].outputs[0]
            assert (choice.token_ids, choice.text, choice.finish_reason) == (
                want.token_ids,
                want.text,
                want.finish_reason,
            )
            assert [sorted(p) for p in choice.logprobs] == [sorted(p) for p in want.logprobs]
        assert len({tuple(c.token_ids) for c in outputs}) > 1  # the streams differ


def test_the_prompt_is_computed_once_and_the_partial_block_copied_on_write(monkeypatch):
    engine = LLMEngine(chunk_size=64, block_size=4, num_kv_blocks=64)
    prompt = engine.tokenizer.encode(PROMPTS[2])
    assert len(prompt) % 4 != 0, "the test needs a partial last prompt block"
    copies = []
    copy_blocks = engine.model.ops.copy_blocks

    def spy(kv_cache, sources, destinations):
        # the source still holds the prompt's K/V when the copy runs
        copies.append((list(sources), list(destinations), kv_cache[0][0][sources].copy()))
        copy_blocks(kv_cache, sources, destinations)

    monkeypatch.setattr(engine.model.ops, "copy_blocks", spy)
    out = run(engine, {"a": (prompt, SamplingParams(n=4, temperature=0, max_tokens=6))})["a"]
    assert sum(r.num_prefill_tokens for r in engine.step_records) == len(prompt)  # once, not 4 times
    # 4 choices share the partial block: the first 3 writers copy it, the last writes in place
    assert sum(len(s) for s, _, _ in copies) == 3
    assert all(len(set(s)) == 1 for s, _, _ in copies)
    greedy = LLM(chunk_size=64, block_size=4, num_kv_blocks=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6)
    )
    assert all(c.token_ids == greedy[0].outputs[0].token_ids for c in out.outputs)
    assert all(np.any(block != 0) for _, _, block in copies)


def test_preemption_and_abort_with_shared_blocks():
    # 12 blocks of 4 tokens cannot hold 3 prompts x 3 choices growing to 30 tokens: choices get preempted
    options = dict(chunk_size=16, block_size=4, num_kv_blocks=12)
    params = SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True)
    engine = LLMEngine(**options)
    together = run(engine, {f"r{i}": (p, params) for i, p in enumerate(PROMPTS[:2])})
    assert engine.scheduler.num_preemptions > 0
    alone = LLM(**options).generate(
        PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    for i, want in enumerate(alone):
        assert all(c.token_ids == want.outputs[0].token_ids for c in together[f"r{i}"].outputs)

    engine = LLMEngine(chunk_size=16, block_size=4, num_kv_blocks=64)
    engine.add_request("x", PROMPTS[0], SamplingParams(n=3, max_tokens=50, ignore_eos=True), stream=True)
    for _ in range(4):
        outputs = engine.step()
        engine.check_invariants()
    assert len(outputs[0].outputs) == 3 and not outputs[0].finished
    engine.abort_request("x")
    aborted = engine.step()
    assert aborted[0].finished and {c.finish_reason for c in aborted[0].outputs} == {"abort"}
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_stream_outputs_carry_every_choice():
    engine = LLMEngine(chunk_size=64, block_size=4, num_kv_blocks=64)
    engine.add_request(
        "s", PROMPTS[0], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=5), stream=True
    )
    seen = []
    while engine.has_unfinished_requests():
        seen += [out for out in engine.step() if out.request_id == "s"]
    assert all(len(out.outputs) == 2 for out in seen) and seen[-1].finished
    assert [len(c.token_ids) for c in seen[-1].outputs] == [5, 5]


@pytest.mark.parametrize("scheduler", ["orca", "faster_transformer"])
def test_policies_that_reserve_the_final_length_copy_into_their_own_reserved_block(scheduler):
    # 16 blocks of 4: every free block is reserved at admission, so the copy of a shared tail must come out of
    # the writer's own reserved blocks (the free list is empty)
    options = dict(scheduler=scheduler, block_size=4, num_kv_blocks=16)
    params = SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)
    together = run(LLMEngine(**options), {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)})
    alone = LLM(**options).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for i, want in enumerate(alone):
        assert [c.token_ids for c in together[f"r{i}"].outputs] == [want.outputs[0].token_ids] * 3


def test_choices_count_toward_max_num_seqs():
    engine = LLMEngine(chunk_size=64, block_size=4, num_kv_blocks=128, max_num_seqs=4)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"r{i}", prompt, params)
    most, finished = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        most = max(most, len(engine.scheduler.running))
    # both prompts fit one step's budget, but each becomes 3 sequences: the second waits for the first
    assert most == 3 and sorted(finished) == ["r0", "r1"]
    assert all(len(c.token_ids) == 8 for out in finished.values() for c in out.outputs)
    with pytest.raises(ValueError, match=r"n \(5\) exceeds max_num_seqs \(4\)"):
        engine.add_request("wide", PROMPTS[0], SamplingParams(n=5))
