"""SamplingParams validation: a bad field raises ValueError naming it; good values are normalized."""

import sys

import pytest

from minisarathi.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 2.0),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -1),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", 1.0),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["2"]),
        ("stop_token_ids", 2),
        ("stop_token_ids", [5, 2**63]),
        ("stop_token_ids", [5, True]),
        ("stop_token_ids", [5, 6.0]),
        ("logprobs", -1),
        ("logprobs", 21),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
    ],
)
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_good_values_are_normalized():
    p = SamplingParams(stop="\n", stop_token_ids=(7,), temperature=0, top_k=-1, seed=2**64 - 1, logprobs=0)
    assert p.stop == ["\n"] and p.stop_token_ids == [7] and p.greedy
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert not SamplingParams().greedy
    for edge in (
        dict(top_p=1.0),
        dict(min_p=1.0),
        dict(presence_penalty=-2),
        dict(max_tokens=1, min_tokens=1),
    ):
        SamplingParams(**edge)


def test_structured_without_llguidance_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance then raises ImportError
    with pytest.raises(
        ValueError, match=r"structured outputs need llguidance: pip install 'minisarathi\[structured\]'"
    ):
        SamplingParams(structured={"regex": "a+"})
    assert SamplingParams().grammar is None  # unconstrained requests never import it
