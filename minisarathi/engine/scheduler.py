"""The batching policies of the Sarathi-Serve paper, side by side over one shared bookkeeping base.

Every policy returns, per step, how many tokens of which sequences to compute. A sequence's chunk is
always its next uncomputed tokens; the engine samples when a chunk reaches the sequence's end.
`running` is kept in arrival order, so "newest" is its last element: that is the one preempted
(recompute: all its blocks freed, back to the front of the waiting queue) when a decode or a chunk finds
no block.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from minisarathi.config import EngineConfig
from minisarathi.engine.block_manager import BlockManager
from minisarathi.engine.sequence import Sequence, SequenceStatus

WATERMARK_FRACTION = 0.01   # blocks kept free at admission so running decodes rarely hit a preemption


@dataclass
class SchedulerOutput:
    scheduled: dict[Sequence, int] = field(default_factory=dict)   # sequence -> tokens computed this step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())


class Scheduler:
    """Queues, admission, growth and preemption; a policy only writes `_schedule`."""

    reserve_final_length = False   # True: blocks for the whole final length at admission (never preempts)

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.blocks = block_manager
        self.token_budget = config.chunk_size
        # non-chunking policies run whole prompts, so their token limit must hold the longest one (as vLLM)
        self.prompt_budget = max(config.chunk_size, max_model_len)
        self.watermark = int(WATERMARK_FRACTION * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # the running sequences split once per step (arrival order kept), so each pass below visits only its kind
        self._decoding: list[Sequence] = []
        self._prefilling: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def remove_finished(self, finished: list[Sequence]) -> None:
        """Drop the running sequences that finished this step and free their blocks."""
        if finished:
            gone = set(finished)
            self.running = [s for s in self.running if s not in gone]
            for seq in finished:
                self.blocks.free(seq)

    def schedule(self) -> SchedulerOutput:
        self._decoding, self._prefilling = [], []
        for seq in self.running:
            (self._prefilling if seq.in_prefill else self._decoding).append(seq)
        out = SchedulerOutput()
        self._schedule(out)
        return out

    def _schedule(self, out: SchedulerOutput) -> None:
        raise NotImplementedError

    # building blocks of the policies --------------------------------------------------------------------

    def _decodes(self, out: SchedulerOutput) -> None:
        """One token for every running decode, oldest first, preempting the newest on block shortage."""
        block_size = self.blocks.block_size
        scheduled = out.scheduled
        running = SequenceStatus.RUNNING   # one enum lookup, not one per sequence (slow in Python 3.11)
        for seq in self._decoding:
            if seq.status is not running:
                continue   # preempted earlier in this pass
            # most decodes write into the free slots of their last block and need no allocation
            if seq.num_computed_tokens < len(seq.block_table) * block_size or self._fit(seq, 1, out):
                scheduled[seq] = 1
            else:   # no one newer left to preempt: give up its own blocks
                self._preempt(seq, out)

    def _prefills(self, out: SchedulerOutput, budget: int) -> None:
        """Chunks of admitted, unfinished prefills, then new requests, within `budget` tokens."""
        for seq in self._prefilling:
            if budget <= 0:
                break
            if seq.status is SequenceStatus.RUNNING:   # not preempted earlier in this step
                n = self._fit(seq, min(seq.num_uncomputed_tokens, budget), out)
                if n:
                    out.scheduled[seq] = n
                    budget -= n
        self._admit(out, budget, chunked=True)

    def _admit(self, out: SchedulerOutput, budget: int, chunked: bool) -> None:
        """New requests FCFS while the budget, max_num_seqs and free blocks allow.

        chunked: a prompt may be cut to the budget left; otherwise it goes whole or waits."""
        if out.preempted:   # blocks are short right now: let the preempted ones settle first
            return
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self.blocks.lookup_prefix(seq)
            remaining = seq.num_tokens - len(cached) * self.blocks.block_size
            n = min(remaining, budget) if chunked else remaining
            if n > budget:
                break
            target = seq.max_kv_tokens if self.reserve_final_length else seq.num_tokens - remaining + n
            watermark = self.watermark if self.running else 0
            if not self.blocks.can_admit(seq, cached, target, watermark):
                break
            self.waiting.popleft()
            self.blocks.admit(seq, cached)
            self.blocks.grow(seq, target)
            seq.status = SequenceStatus.RUNNING
            seq.num_prefill_tokens = seq.num_tokens
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            out.scheduled[seq] = n
            budget -= n

    def _fit(self, seq: Sequence, want: int, out: SchedulerOutput) -> int:
        """Grow seq by up to `want` tokens, preempting newer sequences not yet in this step; returns the grant."""
        while self.blocks.max_growth(seq) < want:
            victim = self.running[-1]
            if victim is seq or victim in out.scheduled:
                break
            self._preempt(victim, out)
        n = min(want, self.blocks.max_growth(seq))
        if n > 0:
            self.blocks.grow(seq, seq.num_computed_tokens + n)
        return n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1


class SarathiScheduler(Scheduler):
    """Stall-free hybrid batches: all decodes, then ongoing chunked prefills, then new prompts, in chunk_size."""

    def _schedule(self, out):
        self._decodes(out)
        self._prefills(out, self.token_budget - len(out.scheduled))


class VllmScheduler(Scheduler):
    """Prefill-prioritizing: whole new prompts alone in a batch whenever any fit; else a decode-only batch."""

    def _schedule(self, out):
        self._admit(out, self.prompt_budget, chunked=False)
        if not out.scheduled:
            self._decodes(out)


class OrcaScheduler(Scheduler):
    """Iteration-level batching: all decodes plus whole new prompts; blocks reserved for the final length."""

    reserve_final_length = True

    def _schedule(self, out):
        self._decodes(out)
        self._admit(out, self.prompt_budget - len(out.scheduled), chunked=False)


class SimpleChunkingScheduler(Scheduler):
    """Chunked prefills in chunk_size, but prefill batches and decode batches take turns (no hybrid)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_was_prefill = False

    def _schedule(self, out):
        # Decodes go when they waited through a prefill batch; either kind goes when the other has nothing
        # to run (a decode that had to preempt itself leaves the turn to the prefills).
        if self.last_was_prefill and self._decoding:
            self._decodes(out)
        if not out.scheduled:
            self._prefills(out, self.token_budget)
        if not out.scheduled:
            self._decodes(out)
        self.last_was_prefill = any(s.in_prefill for s in out.scheduled)


class FasterTransformerScheduler(Scheduler):
    """Static batching: a batch of whole prompts is admitted only when nothing runs, then decoded to the end."""

    reserve_final_length = True

    def _schedule(self, out):
        if self.running:
            self._decodes(out)
        else:
            self._admit(out, self.prompt_budget, chunked=False)


POLICIES = {
    "sarathi": SarathiScheduler,
    "vllm": VllmScheduler,
    "orca": OrcaScheduler,
    "simple_chunking": SimpleChunkingScheduler,
    "faster_transformer": FasterTransformerScheduler,
}


def make_scheduler(config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> Scheduler:
    return POLICIES[config.scheduler](config, block_manager, max_model_len)
