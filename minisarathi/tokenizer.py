"""The Hugging Face `tokenizers` wrapper: BOS/EOS as the model folder says, and streaming detokenization.

Text rule: the text of a completion is the decoded generated ids *as a continuation of the prompt*,
`decode(prompt_ids + output_ids)[len(decode(prompt_ids)):]`, so "Once upon a time" + [",", "▁there"]
gives ", there" (the decoder's strip of one leading space applies to the prompt, not to the completion),
cut before the stop string completed first. It is streamed in pieces that never split a UTF-8 character.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders
from tokenizers.decoders import DecodeStream

from minisarathi.config import read_json_object
from minisarathi.quant import gguf_tokenizer
from minisarathi.quant.gguf_file import is_gguf

# Prompt tokens that seed the stream decoder: enough context for the decoder to treat the first generated
# token as a continuation (leading space, merged bytes), few enough that seeding costs nothing.
STREAM_CONTEXT = 8
_INVALID_PREFIX = "Invalid prefix"  # DecodeStream's error when new bytes rewrite already released text
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens
# Inputs up to these sizes are (de)tokenized holding the GIL, longer ones with it released
# (Tokenizer._encode). Encoding costs by UTF-8 byte, not by character, so text with any non-ASCII character
# holds the GIL only up to the smaller count (the costs: docs/reliability.md, "Host costs behind limits").
GIL_HOLDING_MAX_CHARS = 512
GIL_HOLDING_MAX_NON_ASCII_CHARS = 64
GIL_HOLDING_MAX_IDS = 256


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table, in which byte-level BPE vocabularies spell their tokens: printable
    bytes stand for themselves, the others, in order, for U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    others = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


def _read_json(path: Path) -> dict:
    return read_json_object(path) if path.is_file() else {}


SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def tokenizer_config(path) -> dict:
    """A model folder's tokenizer_config.json ({} without one), or what a GGUF file's metadata gives of it
    (chat_template, bos_token, eos_token...)."""
    path = Path(path)
    if is_gguf(path):
        return gguf_tokenizer.tokenizer_config(path)
    return _read_json(path / "tokenizer_config.json")


def special_tokens(path: Path) -> dict[str, str]:
    """The model's special tokens by name (bos_token: "<s>", ...): tokenizer_config.json's, with
    special_tokens_map.json's entries over them, as transformers' from_pretrained merges the two files."""
    config = tokenizer_config(path)
    config.update(_read_json(Path(path) / "special_tokens_map.json"))
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        # spelled as a string or as an AddedToken dict
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[name] = value
    return tokens


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos_token: bool | None,
        appended_eos_id: int | None,
    ):
        self.hf = tokenizer  # the tokenizers.Tokenizer underneath
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # None: the tokenizer.json post-processor decides; a bool overrides it (transformers does the same).
        self._add_bos = add_bos_token
        self._appended_eos = appended_eos_id  # tokenizer_config's add_eos_token (rare)
        # a byte-level BPE's tokens spell their bytes in GPT-2's alphabet (its added tokens are plain text)
        self._byte_of = None
        if isinstance(tokenizer.decoder, decoders.ByteLevel):
            self._byte_of = {c: b for b, c in byte_level_alphabet().items()}
            self._added = set(tokenizer.get_added_tokens_decoder())

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        """Load tokenizer.json from a Hugging Face model folder; BOS/EOS ids from its config files (the one
        place that reads them: ModelConfig does not)."""
        path = Path(path)
        if is_gguf(path):  # a GGUF file's vocabulary, rebuilt
            return cls(*gguf_tokenizer.read_tokenizer(path))
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"path: no tokenizer.json in {path}")
        try:
            tokenizer = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises plain Exception for a malformed file
            raise ValueError(f"{path / 'tokenizer.json'}: cannot be loaded ({e})") from None
        tok_config = _read_json(path / "tokenizer_config.json")
        model_config = _read_json(path / "config.json")
        gen_config = _read_json(path / "generation_config.json")

        special = special_tokens(path)

        def token_id(name: str) -> int | None:
            content = special.get(name)
            return tokenizer.token_to_id(content) if content else None

        bos = token_id("bos_token")
        if bos is None:
            bos = gen_config.get("bos_token_id", model_config.get("bos_token_id"))
        # Generation stops at any of them, as in vLLM: the tokenizer's eos_token, then the generation config's
        # eos_token_id (an id or a list), read from generation_config.json, else config.json (transformers'
        # GenerationConfig fallback). Instruct models list their end-of-turn token only there.
        eos = gen_config.get("eos_token_id", model_config.get("eos_token_id"))
        eos_ids = [token_id("eos_token"), *(eos if isinstance(eos, list) else [eos])]
        eos_ids = tuple(dict.fromkeys(t for t in eos_ids if t is not None))
        add_bos = tok_config.get("add_bos_token")
        return cls(
            tokenizer,
            bos,
            eos_ids,
            add_bos if isinstance(add_bos, bool) else None,
            token_id("eos_token") if tok_config.get("add_eos_token") is True else None,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` with the special tokens the model expects (BOS for Llama: "" -> [bos]);
        add_special_tokens=False: the text's own tokens only (a rendered chat template writes its own)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if not text.isascii():  # a lone UTF-16 surrogate is no text: the Rust tokenizer raises TypeError
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"text holds a lone UTF-16 surrogate (U+{ord(text[e.start]):04X}) at {e.start}"
                ) from None
        if not add_special_tokens:
            return self._encode(text, False)
        if self._add_bos is None:
            return self._encode(text, True)
        ids = self._encode(text, False)
        if self._add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if self._appended_eos is not None:
            ids = ids + [self._appended_eos]
        return ids

    # Long inputs go through the batch forms, which release the GIL while they work: encode() and decode() of
    # `tokenizers` hold it for the whole call, which stalled the server's event loop and engine thread even
    # when the call ran on a worker thread. Short ones (a prompt, a stream's seed) do not: a batch call hands
    # its one input to a pool thread, and the wake-ups and the GIL's hand-back cost more than the encode.
    # Same results either way.
    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= (GIL_HOLDING_MAX_CHARS if text.isascii() else GIL_HOLDING_MAX_NON_ASCII_CHARS):
            return self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if len(ids) <= GIL_HOLDING_MAX_IDS:
            return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def decoded_token(self, token_id: int) -> str:
        """One token's text on its own, out of context: a SentencePiece "▁" at its start is lost."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def stream_context(self, ids: list[int], skip_special_tokens: bool) -> list[int]:
        """The last tokens of `ids` that seed a DecodeStream, ending at a character boundary."""
        context = list(ids[-STREAM_CONTEXT:])
        # Ids may end inside a character; those bytes must not merge with the next token's.
        while context and self.decode(context, skip_special_tokens).endswith("\ufffd"):
            context.pop()
        return context

    def token_texts(self, context: list[int], token_ids: list[int]) -> list[str]:
        """Each token's text if it came right after `context`: what it adds to the decoded text (a "▁" is the
        space it stands for); "" for a byte that leaves a character unfinished or cannot follow."""
        seed = self.stream_context(context, skip_special_tokens=False)
        texts = []
        for token_id in token_ids:
            try:
                texts.append(DecodeStream(seed, skip_special_tokens=False).step(self.hf, token_id) or "")
            except Exception as error:
                if not str(error).startswith(_INVALID_PREFIX):
                    raise
                texts.append("")
        return texts

    def token_bytes(self, token_id: int, text: str) -> bytes:
        """The bytes a token stands for: a byte-level BPE token's bytes or a byte-fallback token's own byte
        (either may be part of a character), else its text's UTF-8."""
        token = self.hf.id_to_token(token_id) or ""
        if self._byte_of is not None and token_id not in self._added:
            return bytes(self._byte_of[c] for c in token)
        match = _BYTE_TOKEN.fullmatch(token)
        return bytes([int(match[1], 16)]) if match else text.encode("utf-8")


class IncrementalDetokenizer:
    """Per-request streaming text: tokens in, stable text out, never broken UTF-8, stop strings cut.

    `add()` returns the text that became final with this token. Text is held back while it could be the
    start of a stop string (only the longest tail that is a prefix of some stop, so at most
    max(len(stop)) - 1 characters). When a stop string appears, even split across tokens or inside one
    token's text, the text before it is released, the stop is reported, and nothing after it ever is.
    The first stop string to be complete wins, as generation would stop there. As in vLLM, a stop string
    counts only once more than `min_tokens` tokens are out: one that ends in the text of the first
    min_tokens tokens is ordinary text (one that starts there and ends later still counts).
    Invariant: the pieces from `add()` plus `flush()` concatenate to `text`.

    Generated bytes that are not valid UTF-8 decode to U+FFFD, as in `decode()`, with two exceptions
    that keep released text final: when they would rewrite text already released (a stray continuation
    byte merges with the character before it), the stream restarts at the new token and drops them, as
    vLLM does; and the bytes of a character left unfinished when the generation ends are dropped.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = list(stop or [])
        # A stop can only start at its first character: per token, only the stops whose first character is in
        # the text that could hold their start are searched, so the work per token follows that text's length,
        # not the number of stops (16 stops searched one by one were 15% of a 33-request step).
        self._stops_by_first: dict[str, list[str]] = {}
        for s in sorted(self._stops):  # sorted: the stops a text is a proper prefix of follow it (bisect)
            self._stops_by_first.setdefault(s[0], []).append(s)
        self._longest_stop = max(map(len, self._stops), default=0)
        self._shortest_stop = min(map(len, self._stops), default=0)
        self._unchecked_tokens = min_tokens  # tokens still to come whose text cannot end a stop string
        self._stream = DecodeStream(
            tokenizer.stream_context(prompt_ids, skip_special_tokens), skip_special_tokens=skip_special_tokens
        )
        self._held = ""  # decoded text not yet released: it may start a stop string
        self.text = ""  # all text released so far
        self.stop_hit: str | None = None  # the stop string that ended the text, once one has
        self.last_piece = ""  # the text the last token added, before any stop-string cut

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tokenizer.hf, token_id) or ""
        except Exception as error:
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._tokenizer.hf, token_id) or ""

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Feed one generated token; returns (newly final text, the stop string hit or None)."""
        if self.stop_hit is not None:
            raise ValueError("token_id: the text already ended at a stop string")
        if not self._stops:
            self.last_piece = self._step(token_id)
            return self._release(self.last_piece), None
        self.last_piece = self._step(token_id)
        pending = self._held + self.last_piece
        # The stop completed first ends the text (of two ending together, the longer). Only stops ending in
        # the new text count: any other was either found already or ended before min_tokens.
        hits = []
        if self._unchecked_tokens > 0:
            self._unchecked_tokens -= 1
        elif len(pending) >= self._shortest_stop:  # a stop is found within pending: the text before is out
            old = len(self._held)
            stops = self._stops_starting_in(pending[max(0, old - self._longest_stop + 1) :])
            hits = [
                (start + len(s), start, s)
                for s in stops
                if (start := pending.find(s, max(0, old - len(s) + 1))) >= 0
            ]
        if hits:
            _, start, self.stop_hit = min(hits)
            self._held = ""
            return self._release(pending[:start]), self.stop_hit
        cut = self._stop_prefix_start(pending)
        self._held = pending[cut:]
        return self._release(pending[:cut]), None

    def flush(self) -> str:
        """At finish (length, EOS, abort): the held-back text, which no later token can turn into a stop."""
        held, self._held = self._held, ""
        return self._release(held)

    def _stop_prefix_start(self, text: str) -> int:
        """Where the longest tail of `text` that is a proper prefix of a stop string starts (len if none)."""
        start = len(text)
        begin = max(0, start - self._longest_stop + 1)  # a longer tail is a prefix of no stop
        firsts = self._stops_by_first.keys()
        if len(firsts) > start - begin:  # more first characters than the tail has: only the tail's
            firsts = firsts & set(text[begin:])
        for first in firsts:  # (a find per first character is cheaper than a set of the tail's)
            # Each place of the first character is looked up once among the stops starting with it: maximal
            # lists whose stops all start with a common character (" ") were searched stop by stop.
            stops = self._stops_by_first[first]
            i = text.find(first, begin)
            while 0 <= i < start:
                # the stops the tail is a proper prefix of sort right after it
                j = bisect_right(stops, text[i:])
                if j < len(stops) and stops[j].startswith(text[i:]):
                    start = i
                    break
                i = text.find(first, i + 1)
        return start

    def _stops_starting_in(self, text: str) -> list[str]:
        """The stops whose first character occurs in text."""
        firsts = self._stops_by_first.keys() & set(text)
        return [stop for first in firsts for stop in self._stops_by_first[first]]

    def _release(self, piece: str) -> str:
        self.text += piece
        return piece
