"""What generation returns, in vLLM's shapes: one RequestOutput per prompt."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str  # stable text so far; never retracted (stop-string look-ahead is held back)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: sampled token + top k


@dataclass
class RequestMetrics:
    """The request's timeline (time.monotonic() seconds); the benchmark's metrics are computed from it."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token, first included
    chunk_times: list[tuple[float, int]] = field(default_factory=list)  # (step start, prefill tokens)
    preemption_times: list[float] = field(default_factory=list)
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    embedding: Any = None  # an embedding request's: float32[dimensions], L2-normalised (model/pooling.py)
