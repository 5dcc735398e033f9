"""Tokenizer wrapper and streaming detokenizer on the bundled model's real tokenizer (BPE, byte fallback)."""

import json
import random
import shutil

import pytest

from minisarathi.paths import default_model_dir
from minisarathi.tokenizer import IncrementalDetokenizer, Tokenizer

MODEL = default_model_dir()
README_STORY = (MODEL / "README.md").read_text().split("```text\n")[1].split("\n```")[0]
BYTE_TOKENS = range(3, 259)  # <0x00>..<0xFF>
WORD_TOKENS = range(259, 512)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(MODEL)


def stream(tok, prompt_ids, output_ids, stop=(), skip_special_tokens=True):
    """Feed output_ids until a stop hits; returns (pieces incl. the flush, stop hit, detokenizer)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, list(stop), skip_special_tokens)
    pieces, hit = [], None
    for token_id in output_ids:
        piece, hit = detok.add(token_id)
        pieces.append(piece)
        if hit:
            break
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return pieces, hit, detok


def continuation(tok, prompt_ids, output_ids):
    return tok.decode(prompt_ids + output_ids)[len(tok.decode(prompt_ids)) :]


def test_bundled_model_ids(tok):
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 512)
    assert tok.encode("") == [1]
    assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tok.decode(tok.encode("Once upon a time, there was ö株😀")) == "Once upon a time, there was ö株😀"
    assert tok.decode([1, 403, 2], skip_special_tokens=False) == "<s> Once</s>"
    assert [tok.decoded_token(i) for i in (1, 2, 403, 432)] == ["<s>", "</s>", "Once", ","]


def test_readme_story_from_bos_streams_exactly(tok):
    ids = tok.encode(README_STORY)
    pieces, _, detok = stream(tok, [1], ids[1:])
    assert detok.text == README_STORY
    assert "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize(
    "prompt, full",
    [
        (
            "Once upon a time",
            "Once upon a time, there was a little girl named Lily. She loved to play outside "
            "in the park. One day, she saw a big, red ball.",
        ),
        ("Tom had a red", "Tom had a red ball. He liked to play with his toys."),
    ],
)
def test_readme_samples_continue_the_prompt(tok, prompt, full):
    # The model's greedy ids for these prompts are exactly these encodings (checked through LLMEngine).
    prompt_ids, full_ids = tok.encode(prompt), tok.encode(full)
    assert full_ids[: len(prompt_ids)] == prompt_ids
    _, _, detok = stream(tok, prompt_ids, full_ids[len(prompt_ids) :])
    assert prompt + detok.text == full


@pytest.mark.parametrize("text", ["ö", "株式会社", "😀 and 🐉!", 'naïve café, 株 😀\n"quoted" ok'])
def test_multibyte_characters_never_break(tok, text):
    prompt_ids = tok.encode("Once upon a time")
    out = tok.encode("Once upon a time " + text)[len(prompt_ids) :]
    assert any(t in BYTE_TOKENS for t in out)
    pieces, _, detok = stream(tok, prompt_ids, out)
    assert detok.text == " " + text == continuation(tok, prompt_ids, out)
    assert not any("\ufffd" in p for p in pieces)


def test_random_word_tokens_follow_the_continuation_rule(tok):
    rng = random.Random(0)
    for _ in range(50):
        prompt = [1] + [rng.choice(WORD_TOKENS) for _ in range(rng.randrange(0, 12))]
        out = [rng.choice(WORD_TOKENS) for _ in range(rng.randrange(1, 30))]
        _, _, detok = stream(tok, prompt, out)
        assert detok.text == continuation(tok, prompt, out)


def test_invalid_bytes_never_raise_or_rewrite_released_text(tok):
    rng = random.Random(1)
    for _ in range(200):
        out = [rng.choice([rng.choice(BYTE_TOKENS), rng.choice(WORD_TOKENS)]) for _ in range(20)]
        detok = IncrementalDetokenizer(tok, [1], [])
        released = ""
        for t in out:
            released += detok.add(t)[0]
            assert detok.text == released
        detok.flush()
    # "ö" then a stray continuation byte: "ö" was released and stays.
    pieces, _, detok = stream(tok, [1], [198, 185, 185, 261])
    assert detok.text.startswith("ö") and detok.text.endswith("a")


def test_prompt_ending_inside_a_character(tok):
    # A prompt given as ids may end with the first byte of "ö"; its bytes stay the prompt's.
    _, _, detok = stream(tok, [1, 403, 198], [261, 378])
    assert detok.text == " a time"


def test_skip_special_tokens_false_keeps_them(tok):
    _, _, detok = stream(tok, [1, 403], [407, 2, 1, 261], skip_special_tokens=False)
    assert detok.text == continuation_special(tok, [1, 403], [407, 2, 1, 261])
    assert "</s><s>" in detok.text


def continuation_special(tok, prompt_ids, output_ids):
    full = tok.decode(prompt_ids + output_ids, skip_special_tokens=False)
    return full[len(tok.decode(prompt_ids, skip_special_tokens=False)) :]


def ids_of(tok, prompt, completion):
    prompt_ids = tok.encode(prompt)
    full = tok.encode(prompt + completion)
    assert full[: len(prompt_ids)] == prompt_ids
    return prompt_ids, full[len(prompt_ids) :]


@pytest.mark.parametrize(
    "stop, expected_text, expected_hit",
    [
        (["girl"], ", there was a little ", "girl"),  # a whole stop inside one step's text
        (["e was"], ", ther", "e was"),  # starts inside a token, spans tokens
        (["was a", ", there"], "", ", there"),  # at the very start; earliest of several
        (["little", "was a"], ", there ", "was a"),  # the first complete wins, not the list order
        (["e", "there"], ", th", "e"),  # "e" is complete before "there" is
        (["ö", "株"], ", there was a little girl ", "ö"),  # a multi-byte character as stop
        (["dragon"], ", there was a little girl ö株.", None),  # no hit: the held-back text is flushed
        (["."], ", there was a little girl ö株", "."),
    ],
)
def test_stop_strings(tok, stop, expected_text, expected_hit):
    prompt_ids, out = ids_of(tok, "Once upon a time", ", there was a little girl ö株.")
    pieces, hit, detok = stream(tok, prompt_ids, out, stop)
    assert (detok.text, hit) == (expected_text, expected_hit)
    assert not any("\ufffd" in p for p in pieces)


def test_stop_holds_back_only_a_possible_stop_start(tok):
    prompt_ids, out = ids_of(tok, "Once upon a time", ", there was a little girl.")
    detok = IncrementalDetokenizer(tok, prompt_ids, ["\n\n", "girl!"])
    for t in out:
        detok.add(t)
        decoded = continuation(tok, prompt_ids, out[: out.index(t) + 1])
        # everything is released except a tail that could start "girl!"
        held = decoded[len(detok.text) :]
        assert decoded.startswith(detok.text) and (held == "" or "girl!".startswith(held))
    assert detok.flush() == "" and detok.text == ", there was a little girl."


def test_flush_releases_the_held_back_text(tok):
    prompt_ids, out = ids_of(tok, "Once upon a time", ", there was a little girl")
    detok = IncrementalDetokenizer(tok, prompt_ids, ["girl!"])
    assert "".join(detok.add(t)[0] for t in out) == detok.text == ", there was a little "
    assert detok.flush() == "girl" and detok.text == ", there was a little girl"


def test_stop_invariants_on_random_text(tok):
    rng = random.Random(2)
    words = ["the", "cat", "ran", "ö", "株", "!", "\n", "a", "big", "dog"]
    for _ in range(100):
        text = " " + " ".join(rng.choice(words) for _ in range(12))
        prompt_ids, out = ids_of(tok, "Once upon a time", text)
        full = continuation(tok, prompt_ids, out)
        stops = [full[i : i + rng.randrange(1, 6)] for i in (rng.randrange(len(full)) for _ in range(2))]
        stops.append("zzz")
        pieces, hit, detok = stream(tok, prompt_ids, out, stops)
        # the stop that is complete first (earliest end; the longer when two end together)
        _, cut, first = min((full.find(s) + len(s), full.find(s), s) for s in stops if s in full)
        assert (detok.text, hit) == (full[:cut], first)


@pytest.mark.parametrize("firsts, longest_held", [(" ", 4), (" abcdeghnortx!", 3)])
def test_held_back_text_is_the_longest_tail_that_could_start_a_stop(tok, firsts, longest_held):
    """Maximal lists of stops (16), sharing their first character (a space) or starting with many different
    ones (more than a short tail has: the detokenizer then looks only for the tail's characters): after each
    token, the text held back is exactly the longest tail of the text so far that is a proper prefix of a
    stop, found by brute force over every tail and stop."""
    rng, first_rng = random.Random(5), random.Random(6)
    words = [" the", " cat", " ran", " a", " big", "!", "\n", " dog", "  "]
    held_lengths = set()
    for _ in range(60):
        prompt_ids, out = ids_of(tok, "Once upon a time", "".join(rng.choice(words) for _ in range(14)))
        stops = [
            first_rng.choice(firsts)
            + "".join(rng.choice("abcdeghnortx ") for _ in range(rng.randrange(1, 10)))
            for _ in range(16)
        ]
        detok = IncrementalDetokenizer(tok, prompt_ids, stops)
        for n, token in enumerate(out, 1):
            if detok.add(token)[1] is not None:
                break
            text = continuation(tok, prompt_ids, out[:n])
            longest = next(
                (
                    text[i:]
                    for i in range(len(text))
                    if any(len(s) > len(text) - i and s.startswith(text[i:]) for s in stops)
                ),
                "",
            )
            assert text[len(detok.text) :] == longest, (stops, text)
            held_lengths.add(len(longest))
    assert max(held_lengths) >= longest_held  # tails of several characters were held


def test_config_variants(tmp_path):
    shutil.copy(MODEL / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": False, "bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.encode("") == [] and tok.encode("Once") == [403]
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2, 7))
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "add_eos_token": True, "bos_token": "<s>", "eos_token": "</s>"})
    )
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.encode("Once") == [1, 403, 2] and tok.eos_token_ids == (2,)


def test_eos_ids_are_the_tokenizers_and_the_generation_configs(tmp_path):
    """vLLM stops at the tokenizer's eos_token and at every generation-config EOS id (e.g. Llama 3 Instruct's
    <|eot_id|>); the generation config is generation_config.json, else config.json."""
    shutil.copy(MODEL / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (2, 5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (2, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (2, 7, 9)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (2, 7, 9)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == ()


def test_bad_input(tok, tmp_path):
    with pytest.raises(ValueError, match="path"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="text"):
        tok.encode([1, 2])
    for text in ("Once \ud800 upon", "é\udfff"):  # a ValueError naming the surrogate, not the Rust TypeError
        for special in (True, False):
            with pytest.raises(ValueError, match=r"lone UTF-16 surrogate \(U\+D[8F]"):
                tok.encode(text, special)
    assert tok.decode(tok.encode("é upon", False)) == "é upon"  # other non-ASCII text still encodes
    detok = IncrementalDetokenizer(tok, [1], ["Once"])
    assert detok.add(403) == ("", "Once")
    with pytest.raises(ValueError, match="token_id"):
        detok.add(407)


def test_stop_strings_count_only_after_min_tokens(tok):
    """vLLM's rule: a stop string ending in the text of the first min_tokens tokens is ordinary text; one that
    ends later counts, even when it started earlier."""
    prompt = tok.encode("Once upon a time")
    output = tok.encode("Once upon a time, there was a little girl named Lily. She was little.")[1:]
    full = continuation(tok, prompt, output)
    # a stop string inside each token's own text, first met in token 9 (" little") and again later
    pieces = [continuation(tok, prompt, output[: i + 1]) for i in range(len(output))]
    first = next(i for i, text in enumerate(pieces) if "little" in text)
    second = full.index("little", full.index("little") + 1)

    def run(min_tokens, stop):
        detok = IncrementalDetokenizer(tok, prompt, [stop], min_tokens=min_tokens)
        for n, token_id in enumerate(output, start=1):
            _, hit = detok.add(token_id)
            if hit:
                return n, detok.text
        return None, detok.text + detok.flush()

    assert run(0, "little") == (first + 1, full[: full.index("little")])
    assert run(first + 1, "little") == (
        next(i for i, t in enumerate(pieces) if t.count("little") == 2) + 1,
        full[:second],
    )
    # a stop that starts in the unchecked text and ends in the first checked token still counts
    end = len(pieces[first])  # text through the token that completes " little"
    straddle = full[end - 3 : end + 4]  # "tle" + the next characters
    n = next(i for i, t in enumerate(pieces) if len(t) >= end + 4)
    assert run(first + 1, straddle) == (n + 1, full[: end - 3])
    # min_tokens beyond the output: never stops
    assert run(len(output), "little") == (None, full)


def test_token_texts_and_bytes_in_context(tok):
    # "▁" words and byte-fallback characters (株, 😀 are 3 and 4 byte tokens here)
    prompt, ids = (
        tok.encode("Once upon a time"),
        tok.encode(" there was ö株😀 Lily", add_special_tokens=False),
    )
    assert any(tok.hf.id_to_token(i).startswith("<0x") for i in ids), "the test needs byte tokens"
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = []
    for token_id in ids:
        detok.add(token_id)
        pieces.append(detok.last_piece)
    assert "".join(pieces) == detok.text == continuation(tok, prompt, ids)
    assert b"".join(tok.token_bytes(i, piece) for i, piece in zip(ids, pieces)) == detok.text.encode()
    # a candidate's text after a context is what it would add there
    assert tok.token_texts(prompt, ids[:2]) == [continuation(tok, prompt, ids[:1])] + [
        continuation(tok, prompt, ids[1:2])
    ]
    assert tok.token_texts(prompt, ids[:1]) == [" there"] != [tok.decoded_token(ids[0])]
