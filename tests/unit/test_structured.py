"""Structured outputs (minisarathi/structured.py) on the bundled model: every output under a JSON schema
parses and validates (jsonschema), regexes and choices match, an unconstrained request beside constrained ones
keeps its tokens, and a refused constraint fails at admission."""

import json
import re

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="structured outputs need the structured extra (llguidance)")
jsonschema = pytest.importorskip("jsonschema", reason="the schema checks need jsonschema (the test extra)")

from minisarathi import structured  # noqa: E402
from minisarathi.backends.cpu import native_sampling  # noqa: E402
from minisarathi.engine.engine import LLMEngine  # noqa: E402
from minisarathi.llm import LLM  # noqa: E402
from minisarathi.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["Once upon a time", "Tom had a red", "Lily and Tom went to the park. They saw", "The cat"]

# Bounded, so that every output can finish within MAX_TOKENS even one byte a token.
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    {"enum": ["red", "green", "blue", 7, None]},
    {"type": "boolean"},
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["ok", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "string", "maxLength": 4}]},
    {"type": "string", "minLength": 2, "maxLength": 12},
    {
        "type": "object",
        "properties": {"kind": {"const": "dog"}, "legs": {"type": "integer", "minimum": 3, "maximum": 4}},
        "required": ["kind", "legs"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 9},
                "done": {"type": "boolean"},
            },
            "required": ["id", "done"],
            "additionalProperties": False,
        },
        "maxItems": 2,
    },
]
MAX_TOKENS = 120


def texts(outputs):
    return [c for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=256, num_kv_blocks=2048)


def test_200_outputs_under_10_schemas_parse_and_validate_greedy_and_sampled(llm):
    prompts, params, schemas = [], [], []
    for k, schema in enumerate(SCHEMAS):
        structured_params = {"json": schema}
        for prompt in PROMPTS:  # greedy: 4 prompts x 1
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=structured_params))
            schemas.append(schema)
        for prompt in PROMPTS[:2]:  # temperature 1.0: 2 prompts x 8 choices, seeded
            prompts.append(prompt)
            params.append(
                SamplingParams(
                    temperature=1.0, n=8, seed=k, max_tokens=MAX_TOKENS, structured=structured_params
                )
            )
            schemas.append(schema)
    outputs = llm.generate(prompts, params)
    checked = 0
    for output, schema in zip(outputs, schemas):
        for choice in output.outputs:
            assert choice.finish_reason == "stop", (schema, choice.text)
            jsonschema.validate(json.loads(choice.text), schema)
            checked += 1
    assert checked == 200
    sampled = [c.text for o, p in zip(outputs, params) if p.n == 8 for c in o.outputs]
    assert len(set(sampled)) > 40  # the draws differ: the mask leaves the model its choices
    # negative control: the validator refuses an output of another schema
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(outputs[0].outputs[0].text), SCHEMAS[1])


def test_the_outputs_are_not_json_without_the_constraint(llm):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30))
    for choice in texts(outputs):
        with pytest.raises(ValueError):
            json.loads(choice.text)


def test_regex_choice_grammar_and_json_object(llm):
    forms = [
        ({"regex": "[a-z]{3,8}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{3,8}-[0-9]{2}", t)),
        ({"choice": ["cat", "dog", 'a "quoted" bird']}, lambda t: t in ("cat", "dog", 'a "quoted" bird')),
        (
            {"grammar": 'start: "yes" | "no" | "n" NUM\nNUM: /[0-9]/'},
            lambda t: re.fullmatch("yes|no|n[0-9]", t),
        ),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ]
    for spec, check in forms:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=spec)
        sampled = SamplingParams(temperature=1.0, n=6, seed=3, max_tokens=MAX_TOKENS, structured=spec)
        outputs = llm.generate([PROMPTS[0], PROMPTS[1]], [greedy, sampled])
        for choice in texts(outputs):
            if spec.get("json_object") and choice.finish_reason == "length":
                continue  # any object may run long: that it ends with "length" is the contract
            assert choice.finish_reason == "stop" and check(choice.text), (spec, choice.text)


def test_an_unconstrained_request_keeps_its_tokens_beside_constrained_ones():
    options = dict(chunk_size=16, block_size=4, num_kv_blocks=512)
    plain = [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=1.0, seed=5, max_tokens=40),
    ]
    alone = LLM(**options).generate([PROMPTS[2], PROMPTS[3]], plain)
    mixed_params = [SamplingParams(temperature=1.0, n=3, max_tokens=40, structured={"json": SCHEMAS[0]})]
    mixed = LLM(**options).generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]], mixed_params + plain)
    assert [o.outputs[0].token_ids for o in mixed[1:]] == [o.outputs[0].token_ids for o in alone]
    assert all(json.loads(c.text) for c in mixed[0].outputs)


@pytest.mark.parametrize("options", [dict(chunk_size=3, block_size=4), dict(chunk_size=64, block_size=16)])
def test_greedy_constrained_output_is_the_same_whatever_the_chunk_and_block_size(options):
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured={"json": s}) for s in SCHEMAS[:4]
    ]
    base = LLM(chunk_size=512, block_size=16, num_kv_blocks=512).generate(PROMPTS, params)
    other = LLM(**options, num_kv_blocks=512).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in other] == [o.outputs[0].token_ids for o in base]


def test_the_matcher_survives_recompute_preemption():
    """A pool too small for all the requests at once preempts (recompute) and readmits them: each matcher
    only moves on output tokens, so the outputs are those of a roomy pool."""
    params = SamplingParams(temperature=0, max_tokens=60, structured={"json": SCHEMAS[0]})
    prompts = [p + " " + str(i) for i in range(6) for p in PROMPTS[:2]]
    roomy = LLM(block_size=4, num_kv_blocks=512).generate(prompts, params)
    tight = LLM(block_size=4, num_kv_blocks=24)
    small = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in roomy]
    for o in small:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS[0])


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    params = SamplingParams(temperature=0, max_tokens=3, structured={"json": SCHEMAS[0]})
    (choice,) = llm.generate([PROMPTS[0]], params)[0].outputs
    assert choice.finish_reason == "length" and len(choice.token_ids) == 3
    with pytest.raises(ValueError):
        json.loads(choice.text)


def test_a_stop_string_still_ends_a_constrained_request(llm):
    free = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=60, structured={"json": SCHEMAS[0]})
    )
    text = free[0].outputs[0].text
    cut = text.index(",")
    params = SamplingParams(temperature=0, max_tokens=60, structured={"json": SCHEMAS[0]}, stop=[","])
    (choice,) = llm.generate([PROMPTS[0]], params)[0].outputs
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (text[:cut], "stop", ",")


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"json": {"type": "intger"}}, "structured.json is refused by llguidance"),
        ({"json": "{not json"}, "structured.json is not valid JSON"),
        ({"json": [1]}, "structured.json must be a JSON schema object"),
        ({"regex": "[a-"}, "structured.regex is refused by llguidance"),
        ({"grammar": "start: foo"}, "structured.grammar is refused by llguidance"),
        ({"choice": []}, "structured.choice must be a non-empty list"),
        ({"json_object": 1}, "structured.json_object must be true"),
        ({"json": {}, "regex": "a"}, "structured must be a map with one key"),
        ({"xml": "a"}, "structured must be a map with one key"),
        ("a", "structured must be a map with one key"),
        ({"choice": ["x" * 1000] * 70}, "structured.choice must be at most 65536 characters as JSON"),
        ({"json": {"enum": [{1, 2}]}}, "structured.json must be JSON"),
    ],
)
def test_a_refused_constraint_is_a_value_error_naming_it(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured=spec)


def test_min_tokens_is_refused_with_a_constraint():
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured"):
        SamplingParams(min_tokens=2, structured={"regex": "a+"})


def test_a_grammar_refused_with_the_tokenizer_fails_the_whole_batch_at_admission(llm):
    """llguidance checks special tokens only with the engine's tokenizer: prepare_request refuses it, before
    anything of the batch runs."""
    refused = SamplingParams(structured={"grammar": 'start: "a" <|nope|>'})  # no such special token here
    steps = len(llm.engine.step_records)
    with pytest.raises(ValueError, match="structured is refused by llguidance: .*unknown special token"):
        llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=4), refused])
    assert len(llm.engine.step_records) == steps and not llm.engine.has_unfinished_requests()


def test_unconstrained_steps_skip_the_mask(llm, monkeypatch):
    calls = []
    monkeypatch.setattr(structured, "compute_bitmask", lambda *a: calls.append(a))
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4))
    assert calls == []


@pytest.mark.parametrize("vocab", [5, 64, 100, 512])
def test_the_native_bitmask_kernel_matches_numpy(vocab, monkeypatch):
    if native_sampling.token_bitmask_kernel() is None:
        pytest.skip("the native sampling library cannot be built here")
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    rows = np.array([4, 0, 2])
    bitmask = rng.integers(-(2**31), 2**31, (3, structured.bitmask_words(vocab)), dtype=np.int64).astype(
        np.int32
    )
    bitmask[1] = -1  # every token allowed
    native = structured.apply_token_bitmask(logits, rows, bitmask)
    monkeypatch.setattr(native_sampling, "token_bitmask_kernel", lambda: None)
    numpy = structured.apply_token_bitmask(logits, rows, bitmask)
    np.testing.assert_array_equal(native, numpy)
    # the reference: bit j of word w of row i's mask allows token 32 w + j of row rows[i]
    want = logits.copy()
    for i, r in enumerate(rows):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                want[r, t] = -np.inf
    np.testing.assert_array_equal(native, want)
    assert np.isneginf(native).any() and not np.isneginf(native[[1, 3]]).any()
    np.testing.assert_array_equal(native[0], logits[0])  # the all-ones row is untouched


def test_each_choice_has_its_own_matcher():
    engine = LLMEngine(num_kv_blocks=256)
    engine.add_request(
        "r", PROMPTS[0], SamplingParams(n=3, temperature=1.0, max_tokens=5, structured={"regex": "[a-z]+"})
    )
    engine.step()
    choices = engine.requests["r"].choices
    assert len({id(c.matcher) for c in choices}) == 3


def test_a_complete_grammar_ends_the_request_without_sampling_eos(llm):
    """When the grammar allows nothing more the request stops at once: no EOS is spent (nor a step), and
    ignore_eos cannot run it on."""
    eos = llm.engine.tokenizer.eos_token_ids
    for ignore_eos in (False, True):
        params = SamplingParams(
            temperature=1.0,
            n=4,
            seed=1,
            max_tokens=50,
            ignore_eos=ignore_eos,
            structured={"choice": ["cat", "dog"]},
        )
        for choice in llm.generate([PROMPTS[0]], params)[0].outputs:
            assert (choice.finish_reason, choice.text in ("cat", "dog")) == ("stop", True)
            assert not set(choice.token_ids) & set(eos)


def test_overlap_gives_the_same_tokens():
    """With overlap, step N+1's forward is issued before step N's tokens reach the matchers; its mask is
    computed after they do, so the tokens are the synchronous engine's."""
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured={"json": SCHEMAS[5]}),
        SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=MAX_TOKENS, structured={"json": SCHEMAS[9]}),
        SamplingParams(temperature=1.0, seed=4, max_tokens=30),
    ]

    def tokens(overlap):
        llm = LLM(overlap=overlap, chunk_size=16, block_size=4, num_kv_blocks=512)
        assert llm.engine.overlap is overlap
        return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:3], params)]

    assert tokens(True) == tokens(False)


def test_logprobs_of_a_constrained_row_are_those_of_its_masked_logits():
    """The masked softmax spreads the mass over the allowed tokens only: each logprob reported is the float64
    log-softmax of the masked row, at least the unmasked one, and every token listed is allowed."""
    from minisarathi.sampler import Sampler

    rng = np.random.default_rng(0)
    vocab = 512
    logits = rng.standard_normal((2, vocab)).astype(np.float32) * 3
    bitmask = np.zeros((1, structured.bitmask_words(vocab)), np.int32)
    allowed = np.array([3, 40, 41, 200, 511])
    for t in allowed:
        bitmask[0, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    masked = structured.apply_token_bitmask(logits, np.array([1]), bitmask)
    params = [SamplingParams(temperature=1.0, seed=1, logprobs=3)] * 2
    out = Sampler(vocab).sample(masked, params, [None, None], [[1], [1]], [[], []])
    assert out.token_ids[1] in allowed
    row = masked[1].astype(np.float64)
    reference = row - (row[allowed].max() + np.log(np.exp(row[allowed] - row[allowed].max()).sum()))
    free = logits[1].astype(np.float64) - np.log(np.exp(logits[1].astype(np.float64)).sum())
    for token, logprob in out.logprobs[1]:
        assert token in allowed
        assert logprob == pytest.approx(reference[token], abs=1e-5) and logprob >= free[token]


def walk(tokenizer, vocab: int, spec: dict, rng: np.random.Generator, max_steps: int = 200) -> list[int]:
    """Tokens drawn uniformly among those the mask allows, until the grammar is complete."""
    matcher = structured.matcher(SamplingParams(structured=spec), tokenizer, vocab)
    tokens = []
    for _ in range(max_steps):
        bitmask = structured.compute_bitmask([matcher], vocab)
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), count=vocab, bitorder="little"))
        token = int(rng.choice(allowed))
        if token in tokenizer.eos_token_ids:
            break
        tokens.append(token)
        if structured.finished(matcher, token):
            break
    return tokens


def test_a_byte_level_bpe_vocabulary_and_a_padded_one():
    """llguidance reads the engine's tokenizer.json whatever its kind: a byte-level BPE (Llama 3, Qwen,
    GPT-2 style), here trained on a few lines, with the model's vocabulary padded past the tokenizer's (ids
    that decode to nothing, never allowed). Every walk of allowed tokens ends as valid JSON."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from minisarathi.tokenizer import Tokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    hf.train_from_iterator(['{"name": "Tom", "age": 3}', "Once upon a time there was a cat."] * 20, trainer)
    tokenizer = Tokenizer(hf, None, (hf.token_to_id("<|endoftext|>"),), None, None)
    vocab = hf.get_vocab_size() + 100  # padded, as checkpoints pad theirs
    rng = np.random.default_rng(0)
    for _ in range(20):
        tokens = walk(tokenizer, vocab, {"json": SCHEMAS[0]}, rng)
        assert max(tokens) < hf.get_vocab_size()
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMAS[0])


def test_a_random_model_with_a_padded_vocabulary(tmp_path):
    """The engine's rows are the model's vocabulary (1000 here), wider than the tokenizer's 512: the padding
    ids are never allowed, and sampled outputs still validate."""
    from minisarathi.bench.random_model import write_random_model

    path = write_random_model(
        tmp_path / "m",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=1000,
    )
    llm = LLM(path, num_kv_blocks=512)
    params = SamplingParams(
        temperature=1.0, n=8, seed=0, max_tokens=MAX_TOKENS, structured={"json": SCHEMAS[8]}
    )
    for choice in llm.generate([PROMPTS[0]], params)[0].outputs:
        assert choice.finish_reason == "stop" and max(choice.token_ids) < 512
        jsonschema.validate(json.loads(choice.text), SCHEMAS[8])


def test_the_step_log_has_the_mask_time(llm):
    steps = len(llm.engine.step_records)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=5))
    plain = llm.engine.step_records[steps:]
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=5, structured={"regex": "[a-z ]+"}))
    constrained = llm.engine.step_records[steps + len(plain) :]
    assert plain and all(r.mask_time < 5e-4 for r in plain)  # one pass over the rows: nothing to mask
    assert constrained and all(0 < r.mask_time < r.execution_time for r in constrained)
    assert np.median([r.mask_time for r in constrained]) > np.median([r.mask_time for r in plain])
