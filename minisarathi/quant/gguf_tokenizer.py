"""A GGUF file's tokenizer, rebuilt as a `tokenizers` Tokenizer from its `tokenizer.ggml.*` metadata, and the
tokenizer settings (chat template, special tokens) a Hugging Face folder keeps in tokenizer_config.json.

Two vocabularies, as llama.cpp (src/llama-vocab.cpp) reads them:
- `llama`: SentencePiece BPE with scores. A BPE model with byte fallback to the `<0xXX>` tokens, `▁` for
  spaces, merges from `tokenizer.ggml.merges` or else from the scores.
- `gpt2`: byte-level BPE (Llama 3, Qwen2, Mistral Nemo, GPT-2). Tokens and merges are in GPT-2's byte-to-
  character alphabet; `tokenizer.ggml.pre` names the regular expressions that split the text before BPE.
  They are the ones each model's own tokenizer.json splits with (llama.cpp carries rewrites of some of them
  for its regex engine; `tokenizers` runs the originals).
Control and unknown tokens become special added tokens, user-defined ones plain added tokens (the converter
stores those as raw text, not in the byte alphabet).
"""

from __future__ import annotations

from dataclasses import dataclass

from minisarathi.quant.gguf_file import UnsupportedGGUF, metadata

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
TOKENIZER_MODELS = ("llama", "gpt2")

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How a `gpt2` vocabulary splits text: regexes applied one after another (each splits the pieces of
    the one before, matches and the text between them kept), NFC first or not, llama.cpp's add_bos default
    and whether a piece that is itself a token skips the merges (Llama 3's `ignore_merges`)."""

    regexes: tuple[str, ...]
    nfc: bool = False
    add_bos: bool = False
    ignore_merges: bool = False


_LLAMA3 = PreTokenizer((LLAMA3,), add_bos=True, ignore_merges=True)
_QWEN2 = PreTokenizer((QWEN2,), nfc=True)
# tokenizer.ggml.pre -> its pre-tokenizer, under llama.cpp's names (its converter picks one by hashing the
# model's tokenizer) for the Llama, Mistral and Qwen2 families
PRE_TOKENIZERS = {
    # llama.cpp's split for a file without a name: punctuation runs, GPT-2's split, digit runs, threes
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt-2": PreTokenizer((GPT2,)),
    "llama-bpe": _LLAMA3,  # Llama 3
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "tekken": PreTokenizer((TEKKEN,), add_bos=True, ignore_merges=True),  # Mistral Nemo
    "smollm": PreTokenizer((r"\p{N}", GPT2)),  # a Llama: digits one by one, then GPT-2's split
}
# Tokens llama.cpp also ends generation at when the file names no EOT token, found by their text
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>")


# tokenizer.ggml.{key}_token_id -> tokenizer_config.json's name (gguf spells "seperator" so)
SPECIAL_TOKEN_KEYS = {
    "bos": "bos_token",
    "eos": "eos_token",
    "unknown": "unk_token",
    "padding": "pad_token",
    "seperator": "sep_token",
}


def read_tokenizer(path):
    """(tokenizers.Tokenizer, bos id, eos ids, add_bos, appended eos id) as tokenizer.Tokenizer takes
    them, rebuilt from the file's tokenizer.ggml.* metadata."""
    meta = metadata(path)
    model = meta.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise UnsupportedGGUF(
            f"{path}: tokenizer model {model!r} is not supported (supported: {', '.join(TOKENIZER_MODELS)})"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise UnsupportedGGUF(f"{path}: the metadata has no tokenizer.ggml.tokens")
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * n
    merges = meta.get("tokenizer.ggml.merges")
    if model == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * n
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        hf = llama_tokenizer(tokens, scores, types, merges, unk, add_space_prefix)
        default_add_bos = True
    else:
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            supported = ", ".join(PRE_TOKENIZERS)
            raise UnsupportedGGUF(
                f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: {supported})"
            )
        if not merges:
            raise UnsupportedGGUF(f"{path}: the gpt2 tokenizer has no tokenizer.ggml.merges")
        hf = byte_level_tokenizer(tokens, types, merges, PRE_TOKENIZERS[pre])
        default_add_bos = PRE_TOKENIZERS[pre].add_bos
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    ends = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eot", "eom")]
    if ends[0] is None:
        ends += [i for i, t in enumerate(tokens) if types[i] == CONTROL and t in END_OF_TURN]
    eos_ids = tuple(dict.fromkeys(t for t in (eos, *ends) if t is not None))
    return hf, bos, eos_ids, add_bos and bos is not None, eos if add_eos else None


def tokenizer_config(path) -> dict:
    """What a Hugging Face folder's tokenizer_config.json would say of the file's tokenizer: its
    `chat_template` and the text of its special tokens (bos_token, eos_token, ...) where the file has them."""
    meta = metadata(path)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {}
    for key, name in SPECIAL_TOKEN_KEYS.items():
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(i, int) and 0 <= i < len(tokens):
            config[name] = tokens[i]
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _added_tokens(hf, tokens, types) -> None:
    from tokenizers import AddedToken

    special = [i for i, t in enumerate(types) if t in (UNKNOWN, CONTROL)]
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    user = [i for i, t in enumerate(types) if t == USER_DEFINED]
    if user:
        hf.add_tokens([AddedToken(tokens[i], normalized=False) for i in user])


def byte_level_tokenizer(tokens, types, merges, pre: PreTokenizer):
    """A `tokenizers` byte-level BPE tokenizer: the text (NFC first where the model's is) split by
    `pre.regexes`, its bytes mapped to GPT-2's characters, BPE with the file's merges, decoded back."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    pairs = [tuple(m.split(" ", 1)) for m in merges]  # the alphabet has no space: "Ġ" stands for it
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        hf.normalizer = normalizers.NFC()
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = decoders.ByteLevel()
    _added_tokens(hf, tokens, types)
    return hf


def merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's: it joins the adjacent pair whose joined piece scores
    highest, so each split of a normal piece into two pieces is a merge, ranked by that piece's score."""
    index = {t: i for i, t in enumerate(tokens)}
    merges = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL or len(piece) < 2:
            continue
        splits = [
            (piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in index and piece[k:] in index
        ]
        # of one piece's splits, the one whose parts score higher first (transformers' GGUF converter's order)
        splits.sort(key=lambda lr: (scores[index[lr[0]]], scores[index[lr[1]]]), reverse=True)
        merges.extend((-scores[i], i, n, split) for n, split in enumerate(splits))
    return [split for *_, split in sorted(merges)]


def llama_tokenizer(tokens, scores, types, merges, unk, add_space_prefix: bool):
    """A `tokenizers` BPE tokenizer of a SentencePiece/llama vocabulary: byte fallback to `<0xXX>` tokens,
    `▁` for spaces (one prepended to each piece of text), merges from the file or else from the scores."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = merges_from_scores(tokens, scores, types)
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(
        vocab,
        pairs,
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    hf = HFTokenizer(bpe)
    # llama.cpp prefixes a space to every piece of text, at the start and after each special token, even
    # one that starts with a space (as Hugging Face's legacy Llama tokenizer); Metaspace's "first" would not
    spaces = [normalizers.Replace(" ", "▁")]
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁")] * add_space_prefix + spaces)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(steps)
    _added_tokens(hf, tokens, types)
    return hf
