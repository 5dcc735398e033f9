"""Vocabulary-only GGUF files (tokenizer metadata, no tensors), like llama.cpp's models/ggml-vocab-*.gguf,
written as its convert_hf_to_gguf.py writes a byte-level BPE (`gpt2`) tokenizer: the tokens in GPT-2's
byte-to-character alphabet, added tokens as raw text, CONTROL for special added tokens and USER_DEFINED for
the others, the merges as "left right" strings, `tokenizer.ggml.pre` naming the pre-tokenizer.

The sources: a Hugging Face tokenizer.json, or a tiktoken rank file (Qwen's, GPT-2's), whose merges are
recovered from the ranks as transformers' tiktoken converter does.

gguf_vocab/ holds llama.cpp's tokenizer test strings (inputs.inp) and, per vocabulary, the Hugging Face
tokenizer's ids for each (llama-bpe.out: Llama 3, qwen2.out: Qwen2, gpt-2.out: GPT-2), from its
models/ggml-vocab-*.gguf.inp/.out.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import gguf

from minisarathi.tokenizer import byte_level_alphabet

GOLDEN = Path(__file__).resolve().parent / "gguf_vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"  # between two strings of an .inp file


def golden_inputs() -> list[str]:
    return (GOLDEN / "inputs.inp").read_text(encoding="utf-8").split(SEPARATOR)[:-1]


def golden_ids(name: str) -> list[list[int]]:
    lines = (GOLDEN / f"{name}.out").read_text(encoding="utf-8").splitlines()
    return [[int(i) for i in line.split()] for line in lines]


def from_tokenizer_json(spec: dict) -> dict:
    """tokens, token types and merges of a byte-level BPE tokenizer.json (its `model` and `added_tokens`)."""
    model = spec["model"]
    if model["type"] != "BPE" or model.get("byte_fallback"):
        raise ValueError("only a byte-level BPE tokenizer.json is converted here")
    added = {t["id"]: t for t in spec["added_tokens"]}
    size = max([*model["vocab"].values(), *added]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]  # ids no entry names, as the converter fills them
    types = [gguf.TokenType.UNUSED] * size
    for piece, i in model["vocab"].items():
        tokens[i], types[i] = piece, gguf.TokenType.NORMAL
    for i, token in added.items():
        tokens[i] = token["content"]
        types[i] = gguf.TokenType.CONTROL if token["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"tokens": tokens, "types": [int(t) for t in types], "merges": merges}


def from_tiktoken(path: Path, specials: dict[int, str]) -> dict:
    """tokens, token types and merges of a tiktoken rank file (base64 token, rank per line), the token of
    rank r being id r, and `specials` (id -> text) as control tokens after them."""
    ranks = {}
    for line in path.read_text(encoding="ascii").splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    alphabet = byte_level_alphabet()

    def text(piece: bytes) -> str:
        return "".join(alphabet[b] for b in piece)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _bpe(ranks, token, rank)
            merges.append(f"{text(left)} {text(right)}")
    tokens = [text(t) for t, _ in sorted(ranks.items(), key=lambda item: item[1])]
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    for i in sorted(specials):
        if i != len(tokens):
            raise ValueError(f"special token id {i} does not follow the {len(tokens)} tokens")
        tokens.append(specials[i])
        types.append(int(gguf.TokenType.CONTROL))
    return {"tokens": tokens, "types": types, "merges": merges}


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """`token` merged from its bytes by the ranks below max_rank, lowest first: the two parts it is the
    merge of."""
    parts = [bytes([b]) for b in token]
    while True:
        pairs = [(ranks.get(a + b, max_rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank >= max_rank:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} of rank {max_rank} is no merge of two lower-ranked tokens")
    return parts


def write_vocab_gguf(out: Path, vocab: dict, pre: str, **settings) -> Path:
    """A vocabulary-only GGUF file at `out` of `vocab` (from_tokenizer_json's or from_tiktoken's dict);
    settings as add_vocab takes them."""
    writer = gguf.GGUFWriter(str(out), "llama")
    add_vocab(writer, vocab, pre, **settings)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_vocab(
    writer: gguf.GGUFWriter,
    vocab: dict,
    pre: str,
    *,
    bos: int | None = None,
    eos: int | None = None,
    add_bos: bool | None = None,
    chat_template: str | None = None,
) -> None:
    """The tokenizer.ggml.* fields of a byte-level BPE `vocab`, and a chat template, added to `writer`."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    if bos is not None:
        writer.add_bos_token_id(bos)
    if eos is not None:
        writer.add_eos_token_id(eos)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def tokenizer_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))
