"""Per-request sampling settings (vLLM's names), validated when built so a bad request fails alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minisarathi import structured as structured_outputs
from minisarathi.validation import check_float, check_int

# The smallest normal float32: the sampler works in float32, where a smaller positive number is 0 or loses
# precision, and the reciprocal of a smaller one overflows.
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or output (CTRL-style)
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # k: return the sampled token's logprob plus the top k
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: no text (and no stop strings), token ids only; saves CPU per token
    logit_bias: dict[int, float] | None = None  # added to these token ids' logits (OpenAI's; in [-100, 100])
    # a constraint on the output, e.g. {"json": schema}; its forms: minisarathi/structured.py
    structured: dict | None = None

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"{name} must be a list, got {getattr(self, name)!r}")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        check_int("n", self.n, lo=1)
        check_int("max_tokens", self.max_tokens, lo=1)
        check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        check_float("temperature", self.temperature)
        if self.temperature < 0 or 0 < self.temperature < _FLOAT32_TINY:
            raise ValueError(
                f"temperature must be 0 or a float32 number >= {_FLOAT32_TINY:.3g}, got {self.temperature}"
            )
        check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_int("top_k", self.top_k, lo=-1)
        check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        check_float("repetition_penalty", self.repetition_penalty)
        # The sampler divides and multiplies float32 logits by it: it and its reciprocal must be finite
        # float32 numbers (1e-300 is 0 in float32, and a logit divided by it is inf).
        if not _FLOAT32_TINY <= self.repetition_penalty <= 1 / _FLOAT32_TINY:
            raise ValueError(
                f"repetition_penalty must be in [{_FLOAT32_TINY:.3g}, {1 / _FLOAT32_TINY:.3g}] "
                f"(float32), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            check_float(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None:
            check_int("seed", self.seed, lo=0, hi=2**64 - 1)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        ids = self.stop_token_ids
        # checked at C speed when all is well (64 ids one by one were a third of validating a request); item
        # by item only to name the first bad one
        if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) > 2**63 - 1):
            for t in ids:
                check_int("stop_token_ids", t, lo=0, hi=2**63 - 1)  # int64 below
        # Made once per request (not fields: the doors take fields from clients). int64[S]: the sampler masks
        # these ids until min_tokens, for the whole batch in one assignment.
        self.stop_token_array = np.array(self.stop_token_ids, np.int64)
        self.stop_token_set = frozenset(self.stop_token_ids)  # checked per token (a list: up to 64 compares)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, lo=0, hi=20)
        for name in ("ignore_eos", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        # llguidance's grammar (JSON text) of the constraint, checked here so a refused one fails in its door
        self.grammar = None if self.structured is None else structured_outputs.grammar(self.structured)
        if self.grammar is not None and self.min_tokens:  # the grammar decides where the output may end
            raise ValueError("min_tokens cannot be combined with structured")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _logit_bias(bias) -> dict[int, float] | None:
    """Token id -> bias; ids may come as decimal strings (JSON object keys always are); {} means none."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map of token id to bias, got {type(bias).__name__}")
    result = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdecimal() else key
        check_int("logit_bias token id", token, lo=0)
        check_float("logit_bias value", value)
        if not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        result[token] = float(value)
    return result or None
