"""Constrained decoding (structured outputs) on llguidance, the optional extra minisarathi[structured].

A request's SamplingParams.structured names one constraint, a map with one key:

    {"json": schema}          a JSON schema (a map, or its JSON text)
    {"json_object": true}     any JSON object
    {"regex": "[a-z]+"}       a regular expression (Rust's regex syntax) the whole output matches
    {"choice": ["yes", "no"]} one of these strings, exactly
    {"grammar": "start: ..."} a Lark grammar in llguidance's dialect (which also takes GBNF-style rules)

Each becomes one internal form, llguidance's grammar (`grammar`, when the SamplingParams are built, so a
refused one fails in the door that parsed it). The engine reaches this module through three hooks:
`matcher` at admission (one LLMatcher per choice, as the choices fork), `mask_logits` before the sampler
(the constrained rows' next-token bitmasks, computed on the host, applied by the sampler's backend: NumPy or
the native CPU kernel, or cuda/token_bitmask.cu), and `finished` after it (the matcher consumes the sampled
token; a grammar that allows nothing more ends the request with "stop"). A matcher only moves on sampled
output tokens, so a recompute preemption, which keeps them, keeps its state.
"""

from __future__ import annotations

import functools
import json
import logging

import numpy as np

from minisarathi.backends.cpu import native_sampling

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Compact JSON: with flexible whitespace a small model can spend max_tokens on blanks between two commas.
JSON_OPTIONS = {"whitespace_flexible": False}
# A constraint's size, as JSON text: it is compiled on the door's event loop, then again on the engine thread
# (what that costs: docs/http.md).
MAX_CONSTRAINT_CHARS = 64 << 10

log = logging.getLogger(__name__)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError(
            "structured outputs need llguidance: pip install 'minisarathi[structured]'"
        ) from None
    return llguidance


def _short(value, limit: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def grammar(spec) -> str:
    """llguidance's grammar (its JSON text) for a SamplingParams.structured map, checked by llguidance
    without a tokenizer; ValueError starting with "structured" and naming the problem otherwise."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ValueError(f"structured must be a map with one key of {', '.join(KINDS)}, got {_short(spec)}")
    ((kind, value),) = spec.items()
    name = f"structured.{kind}"
    try:
        size = len(value) if isinstance(value, str) else len(json.dumps(value))
    except (TypeError, ValueError):  # not JSON (NaN passes: llguidance refuses it below)
        raise ValueError(f"{name} must be JSON, got {_short(value)}") from None
    if size > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{name} must be at most {MAX_CONSTRAINT_CHARS} characters as JSON, got {size}")
    llg = _llguidance()
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"{name} is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a JSON schema object, got {_short(value)}")
        text = llg.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    elif kind == "json_object":
        if value is not True:
            raise ValueError(f"{name} must be true, got {_short(value)}")
        text = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"{name} must be a non-empty list of non-empty strings, got {_short(value)}")
        # JSON's string escapes are Lark's
        text = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    else:
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {_short(value)}")
        convert = llg.LLMatcher.grammar_from_regex if kind == "regex" else llg.LLMatcher.grammar_from_lark
        text = convert(value)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise ValueError(f"{name} is refused by llguidance: {_short(messages[0], 500)}")
    return text


@functools.cache
def _ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the engine's Tokenizer: its tokenizers JSON (no transformers needed), for the
    model's vocab_size rows of logits, ending at the engine's EOS ids. Once per engine: 3 ms at 512 tokens,
    1.7 s at Llama 3's 128k (2-core VM)."""
    llg = _llguidance()
    eos = list(tokenizer.eos_token_ids) or None
    try:
        return llg.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab_size, eos_token=eos)
    except Exception as e:  # llguidance raises plain ValueError/RuntimeError for a tokenizer it cannot read
        raise ValueError(
            f"structured outputs are not available for this tokenizer: {_short(str(e))}"
        ) from None


def matcher(params, tokenizer, vocab_size: int):
    """Hook (engine admission): an LLMatcher for params.grammar over the engine's vocabulary, or None when the
    request is unconstrained; ValueError if llguidance refuses the grammar with this tokenizer."""
    if params.grammar is None:
        return None
    llg = _llguidance()
    result = llg.LLMatcher(_ll_tokenizer(tokenizer, vocab_size), params.grammar, log_level=0)
    if result.is_error():
        raise ValueError(f"structured is refused by llguidance: {_short(result.get_error(), 500)}")
    return result


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@functools.cache
def _executor():
    return _llguidance().LLExecutor()


def compute_bitmask(matchers: list, vocab_size: int) -> np.ndarray:
    """int32[len(matchers), ceil(vocab / 32)]: bit j of word w set where token 32 w + j may come next,
    computed by llguidance's thread pool (it releases the GIL while it works)."""
    words = bitmask_words(vocab_size)
    bitmask = np.empty((len(matchers), words), np.int32)
    _executor().unsafe_compute_mask_ptr(
        [(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data, 4 * words, len(matchers)
    )
    return bitmask


def apply_token_bitmask(logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """A float32 copy of logits [N, V] with the tokens bitmask (int32[len(rows), ceil(V / 32)]) clears in
    row rows[i] set to -inf; the native CPU kernel where it is built, else NumPy, with the same result."""
    x = np.array(logits, np.float32, order="C")  # a copy: the caller's logits stay as they were
    kernel = native_sampling.token_bitmask_kernel()
    if kernel is not None:
        kernel(x, rows, bitmask)
        return x
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=x.shape[1], bitorder="little")
    sub = x[rows]  # float32[R, V]
    sub[allowed == 0] = -np.inf
    x[rows] = sub
    return x


def mask_logits(sampler, logits, samplers: list):
    """Hook (engine, before sampling): logits with every constrained row's forbidden tokens at -inf (a copy,
    on the logits' device), or logits untouched where no row is constrained (one pass over the rows)."""
    rows = [i for i, seq in enumerate(samplers) if seq.matcher is not None]
    if not rows:
        return logits
    bitmask = compute_bitmask([samplers[i].matcher for i in rows], logits.shape[1])
    rows = np.array(rows, np.int64)
    apply = getattr(sampler, "apply_token_bitmask", None)  # the CUDA backend's GpuSampler: on the device
    return apply_token_bitmask(logits, rows, bitmask) if apply is None else apply(logits, rows, bitmask)


def finished(matcher, token: int) -> bool:
    """Hook (engine, after sampling): the matcher consumes the sampled token; whether the grammar is then
    complete and allows nothing more (the request ends with "stop", its text complete)."""
    # Refused only where the mask left a row no token (a bug: min_tokens, the one other mask of -inf, is
    # refused with a constraint); the request then ends rather than run on unconstrained.
    if not matcher.consume_token(token):
        log.warning("the grammar refused token %d: %s", token, _short(matcher.get_error()))
        return True
    return matcher.is_stopped()
