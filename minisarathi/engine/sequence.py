"""One request's state: its tokens, how many of them are in the KV cache, its blocks, and its timeline."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from minisarathi.outputs import RequestMetrics
from minisarathi.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and holding no blocks
    RUNNING = "running"  # admitted: holds blocks, gets chunks or decode slots
    PAUSED = "paused"  # not scheduled (its client is not reading); keeps its blocks unless memory is needed
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # identity equality: sequences are dict keys in the scheduler
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    max_kv_tokens: int  # most tokens it will ever hold in the KV cache (final length - 1)
    generator: Any = None  # numpy Generator of a seeded request; None: the engine's shared one
    detokenizer: Any = None  # IncrementalDetokenizer; None when params.detokenize is False
    matcher: Any = None  # structured outputs: its grammar's llguidance LLMatcher (minisarathi/structured.py)
    pooling: Any = None  # an embedding request's PoolingParams: prefill only, no sampling (model/pooling.py)
    stream: bool = True  # False: outputs only when it finishes
    seq_id: int = -1  # arrival order, given when queued; "newest" = largest
    priority: int = 0  # lower runs first (docs/scheduling.md, "Priorities")
    queue_key: tuple[float, int] = (0.0, -1)  # (arrival time + priority x aging, seq_id), set when queued
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None  # per output token: dict[int, Logprob]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # KV-cache state, owned by the scheduler and the block manager
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the cache
    num_prefill_tokens: int = 0  # length when last admitted: tokens below it are prefill, above decode
    block_table: list[int] = field(default_factory=list)
    block_row: int = -1  # its row of BlockManager.tables while admitted
    # chained hashes of its full blocks, grown on demand
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at first admission
    fork_tail: bool = False  # n > 1: its partial last block may still be shared with another choice
    # n > 1: the request's choices in index order (this one included), shared by all of them; None when n == 1
    choices: list | None = None
    index: int = 0  # its choice index

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def num_seqs(self) -> int:
        """The running sequences it stands for: n before the fork at its prefill's end, then itself alone."""
        return self.params.n if self.choices is None else 1

    @property
    def is_finished(self) -> bool:
        # set with status FINISHED (cheaper to test than an enum in 3.11)
        return self.finish_reason is not None

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole history."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
