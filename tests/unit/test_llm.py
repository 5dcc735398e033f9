"""The offline API: prompt forms, order, per-prompt params, fail-before-running, and the bundled model's
golden story."""

import pytest

from minisarathi import LLM, SamplingParams
from minisarathi.paths import default_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(chunk_size=16, block_size=8, num_kv_blocks=256)


def readme_story():
    """The text block of models/stories260K/README.md: llama2.c's 200-token greedy story from BOS."""
    readme = (default_model_dir() / "README.md").read_text()
    return readme.split("```text\n", 1)[1].split("\n```", 1)[0]


def test_greedy_story_from_bos_matches_llama2c(llm):
    (out,) = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    assert out.outputs[0].text == readme_story()
    assert len(out.outputs[0].token_ids) == 200 and out.finished


def test_prompt_forms_and_order(llm):
    texts = ["Tom had a red", "Once upon a time", "Lily and Tom went to the park."]
    batch = llm.generate(texts, GREEDY)
    assert [o.prompt for o in batch] == texts
    alone = [llm.generate(t, GREEDY)[0] for t in texts]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]
    ids = batch[0].prompt_token_ids
    (by_ids,) = llm.generate(ids, GREEDY)  # one prompt given as token ids
    assert by_ids.prompt is None and by_ids.outputs[0].token_ids == batch[0].outputs[0].token_ids
    assert batch[1].outputs[0].text.startswith(", there was a little girl")


def test_params_per_prompt(llm):
    outs = llm.generate(
        ["Tom had a red", "Tom had a red"],
        [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0, max_tokens=7)],
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    assert outs[1].outputs[0].token_ids[:3] == outs[0].outputs[0].token_ids


def test_bad_prompt_fails_before_anything_runs(llm):
    steps = len(llm.engine.step_records)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(["Tom had a red", [1, 9999]], GREEDY)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([3.5])
    assert len(llm.engine.step_records) == steps and not llm.engine.has_unfinished_requests()
    assert llm.generate([]) == []


def test_seeded_requests_repeat(llm):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    first, second = llm.generate(["Tom had a red", "Tom had a red"], [params, params])
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_priority_orders_the_prompts():
    llm = LLM(chunk_size=16, block_size=8, num_kv_blocks=64, max_num_seqs=1)
    outs = llm.generate(["Tom had a red", "Once upon a time", "Lily went"], GREEDY, priority=[1, 2, 0])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [2, 0, 1]
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids
        for o in llm.generate(["Tom had a red", "Once upon a time", "Lily went"], GREEDY)
    ]
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b"], GREEDY, priority=[0])
    with pytest.raises(ValueError, match="priority"):
        llm.generate("a", GREEDY, priority=0.5)
