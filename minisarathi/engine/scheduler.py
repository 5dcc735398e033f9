"""The batching policies of the Sarathi-Serve paper, side by side over one shared bookkeeping base.

Every policy returns, per step, how many tokens of which sequences to compute. A sequence's chunk is
always its next uncomputed tokens; the engine samples when a chunk reaches the sequence's end.
Both queues are ordered by `Sequence.queue_key`, (arrival time + priority x priority_aging_s, arrival
number): waiting requests are admitted in that order and `running` is kept in it, so its last element,
the latest virtual arrival (not always the lowest priority: aging counts), is the one preempted (recompute:
all its blocks freed, back into the waiting queue at its place) when a decode or a chunk finds no block.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from operator import attrgetter

from minisarathi.config import EngineConfig
from minisarathi.engine.block_manager import BlockManager
from minisarathi.engine.sequence import Sequence, SequenceStatus

WATERMARK_FRACTION = 0.01  # blocks kept free at admission so running decodes rarely hit a preemption
LONG_PREFILL_FRACTION = 0.04  # of max_model_len: the default long_prefill_threshold (vLLM's)
# Why a step admitted no further waiting request (SchedulerOutput.admission_stop); None: none was waiting.
ADMISSION_STOPS = ("budget", "blocks", "max_num_seqs", "partial_prefills", "overload", "preempted")

queue_key = attrgetter("queue_key")


@dataclass
class SchedulerOutput:
    scheduled: dict[Sequence, int] = field(default_factory=dict)  # sequence -> tokens computed this step
    preempted: list[Sequence] = field(default_factory=list)
    admission_stop: str | None = None  # one of ADMISSION_STOPS, or None when nothing was left waiting
    # set by the SLO scheduler (slo_scheduler.py), kept in every step's record
    time_limit: float | None = None  # seconds the step's predicted time may reach
    overloaded: bool = False  # the running decodes alone are predicted over the TBT target

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())


@dataclass
class PrefillBudget:
    """What the prefills of one step may still take."""

    tokens: int  # tokens in all
    token_share: int = 1 << 30  # tokens per prompt (max_partial_prefills: the budget split evenly)


class Scheduler:
    """Queues, admission, growth and preemption; a policy only writes `_schedule`."""

    reserve_final_length = False  # True: blocks for the whole final length at admission (never preempts)

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.blocks = block_manager
        self.token_budget = config.chunk_size
        # non-chunking policies run whole prompts, so their token limit must hold the longest one (as vLLM)
        self.prompt_budget = max(config.chunk_size, max_model_len)
        self.watermark = int(WATERMARK_FRACTION * block_manager.num_blocks)
        self.waiting: list[Sequence] = []  # sorted by queue_key
        self.running: list[Sequence] = []  # sorted by queue_key
        self.paused: list[Sequence] = []  # taken out of scheduling by pause(), oldest pause first
        self.num_preemptions = 0
        self.max_partial_prefills = config.max_partial_prefills
        self.long_prefill_threshold = config.long_prefill_threshold or max(
            1, int(LONG_PREFILL_FRACTION * max_model_len)
        )
        self.max_long_partial_prefills = config.max_long_partial_prefills or 1
        # the running sequences split once per step (queue order kept), so each pass below visits only its
        # kind
        self._decoding: list[Sequence] = []
        self._prefilling: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self._set_queue_key(seq)
        bisect.insort(self.waiting, seq, key=queue_key)

    def _set_queue_key(self, seq: Sequence) -> None:
        """The virtual arrival time (priority p: as if it arrived p x priority_aging_s later), then arrival
        order."""
        seq.queue_key = (seq.metrics.arrival_time + seq.priority * self.config.priority_aging_s, seq.seq_id)

    def add_running(self, seq: Sequence) -> None:
        """A new choice of a running request (n > 1): admitted already, it holds its parent's blocks."""
        seq.status = SequenceStatus.RUNNING
        self._set_queue_key(seq)
        bisect.insort(self.running, seq, key=queue_key)

    def abort(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.PAUSED:
            self.paused.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def pause(self, seq: Sequence) -> None:
        """Stop scheduling seq, keeping its blocks: its batch slot goes to others, and its KV stays until
        memory is needed (then it is preempted like any other). resume() puts it back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        seq.status = SequenceStatus.PAUSED
        self.paused.append(seq)

    def resume(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.PAUSED:
            return
        self.paused.remove(seq)
        if seq.block_table:  # its KV is still there: it goes on where it stopped
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=queue_key)
        else:  # never admitted, or preempted while paused
            seq.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, seq, key=queue_key)

    def _release_paused(self) -> bool:
        """Preempt the most recently paused sequence that holds blocks; False if none does."""
        for seq in reversed(self.paused):
            if seq.block_table:
                self.blocks.free(seq)
                self.num_preemptions += 1
                return True
        return False

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

    def observe(self, predicted: float | None, actual: float) -> None:
        """Hook: after every step, its predicted and measured seconds (the SLO scheduler adapts to them)."""

    def summary(self) -> dict | None:
        """Hook: the state of a budget beyond tokens, for the engine's stats (None: tokens only)."""
        return None

    def is_long(self, seq: Sequence) -> bool:
        """A prompt with more uncomputed tokens than long_prefill_threshold (vLLM's classification)."""
        return seq.num_uncomputed_tokens > self.long_prefill_threshold

    def _partial_counts(self, prefilling: list[Sequence]) -> tuple[int, int]:
        """(prompts mid-prefill, the long ones among them): what the partial-prefill limits count."""
        return len(prefilling), sum(self.is_long(s) for s in prefilling)

    def check_invariants(self) -> None:
        """The fair-prefill limits over the running prompts with prefill left (engine.check_invariants calls
        it after every step in tests; right after schedule() too it must hold)."""
        if self.max_partial_prefills is None:
            return
        num_partial, num_long = self._partial_counts([s for s in self.running if s.in_prefill])
        assert num_partial <= self.max_partial_prefills, (
            f"{num_partial} prompts mid-prefill, over max_partial_prefills ({self.max_partial_prefills})"
        )
        assert num_long <= self.max_long_partial_prefills, (
            f"{num_long} long prompts mid-prefill, over max_long_partial_prefills "
            f"({self.max_long_partial_prefills})"
        )

    # building blocks of the policies --------------------------------------------------------------------

    def _decodes(self, out: SchedulerOutput) -> None:
        """One token per running decode, in queue order; a block shortage preempts the last in queue order."""
        block_size = self.blocks.block_size
        scheduled = out.scheduled
        running = SequenceStatus.RUNNING  # one enum lookup, not one per sequence (slow in Python 3.11)
        for seq in self._decoding:
            if seq.status is not running or seq.num_computed_tokens >= seq.max_kv_tokens:
                continue  # preempted earlier in this pass, or its cache holds all it ever will
            # most decodes write into the free slots of their last block and need no allocation
            if (
                seq.num_computed_tokens < len(seq.block_table) * block_size and not seq.fork_tail
            ) or self._fit(seq, 1, out):
                scheduled[seq] = 1
            else:  # no one later in the queue left to preempt: give up its own blocks
                self._preempt(seq, out)

    def _prefills(self, out: SchedulerOutput, tokens: int) -> None:
        """Chunks of admitted, unfinished prefills, then new requests, within the step's prefill budget."""
        budget = self._prefill_budget(out, tokens)
        for seq in self._prefilling:
            if budget.tokens <= 0:
                break
            if seq.status is SequenceStatus.RUNNING:  # not preempted earlier in this step
                start = seq.num_computed_tokens
                n = self._fit(seq, self._grantable(budget, start, seq.num_uncomputed_tokens), out)
                if n:
                    self._spend(budget, start, n)
                    out.scheduled[seq] = n
        self._admit(out, budget, chunked=True)

    def _prefill_budget(self, out: SchedulerOutput, tokens: int) -> PrefillBudget:
        """Hook: what the prefills of this step may take, `tokens` in all; with max_partial_prefills each
        prompt that will prefill gets an even share (vLLM's rule)."""
        budget = PrefillBudget(tokens)
        if self.max_partial_prefills is not None:
            budget.token_share = max(tokens // self._num_prefill_shares(), 1)
        return budget

    def _grantable(self, budget: PrefillBudget, start: int, remaining: int) -> int:
        """Hook: tokens a prompt at position `start` with `remaining` tokens to compute may take."""
        return min(remaining, budget.tokens, budget.token_share)

    def _spend(self, budget: PrefillBudget, start: int, n: int) -> None:
        """Hook: a prompt at position `start` was granted n tokens."""
        budget.tokens -= n

    def _num_prefill_shares(self) -> int:
        """How many prompts will prefill this step, counted as vLLM does: those mid-prefill, then the waiting
        ones in queue order that the partial-prefill limits let in, at most max_partial_prefills."""
        count, num_long = self._partial_counts(self._prefilling)
        for seq in self.waiting:
            if count >= self.max_partial_prefills:
                break
            if self.is_long(seq):
                if num_long >= self.max_long_partial_prefills:
                    continue
                num_long += 1
            count += 1
        return max(1, min(count, self.max_partial_prefills))

    def _admit(self, out: SchedulerOutput, budget: PrefillBudget, chunked: bool) -> None:
        """New requests in queue order while the budget, max_num_seqs, the partial-prefill limits and free
        blocks allow. A long prompt over max_long_partial_prefills is passed over (later short ones may go
        first); any other obstacle stops admission, and out.admission_stop says which.

        chunked: a prompt may be cut to the budget left; otherwise it goes whole or waits."""
        if not self.waiting:
            return
        if out.preempted:  # blocks are short right now: let the preempted ones settle first
            out.admission_stop = "preempted"
            return
        fair = self.max_partial_prefills is not None
        if fair:
            num_partial, num_long = self._partial_counts(
                [s for s in self._prefilling if s.status is SequenceStatus.RUNNING]
            )
        # n > 1: a prompt not yet forked counts as the n sequences it becomes once its prefill ends
        num_seqs = sum(s.num_seqs for s in self.running)
        stop, passed_over, i = None, False, 0
        while i < len(self.waiting):
            if budget.tokens <= 0:
                stop = "budget"
                break
            seq = self.waiting[i]
            if num_seqs + seq.num_seqs > self.config.max_num_seqs:
                stop = "max_num_seqs"
                break
            if fair:
                if num_partial >= self.max_partial_prefills:
                    stop = "partial_prefills"
                    break
                long = self.is_long(seq)
                if long and num_long >= self.max_long_partial_prefills:
                    passed_over = True
                    i += 1
                    continue
            cached = self.blocks.lookup_prefix(seq)
            start = len(cached) * self.blocks.block_size
            remaining = seq.num_tokens - start
            if chunked:
                n = self._grantable(budget, start, remaining)
            else:
                n = remaining if remaining <= budget.tokens else 0
            if n <= 0:
                stop = "budget"
                break
            target = seq.max_kv_tokens if self.reserve_final_length else start + n
            watermark = self.watermark if self.running else 0
            if not self.blocks.can_admit(seq, cached, target, watermark):
                if self._release_paused():
                    continue
                stop = "blocks"
                break
            del self.waiting[i]
            self.blocks.admit(seq, cached)
            self.blocks.grow(seq, target)
            seq.status = SequenceStatus.RUNNING
            seq.num_prefill_tokens = seq.num_tokens
            bisect.insort(self.running, seq, key=queue_key)
            num_seqs += seq.num_seqs
            out.scheduled[seq] = n
            self._spend(budget, start, n)
            if fair:
                num_partial += 1
                num_long += long
        out.admission_stop = stop or ("partial_prefills" if passed_over else None)

    def _fit(self, seq: Sequence, want: int, out: SchedulerOutput) -> int:
        """Grow seq by up to `want` tokens, preempting sequences later in queue order not yet in this step;
        returns the grant."""
        while self.blocks.max_growth(seq) < want:
            if self._release_paused():  # paused sequences give up their blocks before running ones
                continue
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
        bisect.insort(self.waiting, seq, key=queue_key)
        out.preempted.append(seq)
        self.num_preemptions += 1


class SarathiScheduler(Scheduler):
    """Stall-free hybrid batches in chunk_size: all decodes, then ongoing prefill chunks, then new prompts."""

    def _schedule(self, out):
        self._decodes(out)
        self._prefills(out, self.token_budget - len(out.scheduled))


class VllmScheduler(Scheduler):
    """Prefill-prioritizing: whole new prompts alone in a batch whenever any fit; else a decode-only batch."""

    def _schedule(self, out):
        self._admit(out, PrefillBudget(self.prompt_budget), chunked=False)
        if not out.scheduled:
            self._decodes(out)


class OrcaScheduler(Scheduler):
    """Iteration-level batching: all decodes plus whole new prompts; blocks reserved for the final length."""

    reserve_final_length = True

    def _schedule(self, out):
        self._decodes(out)
        self._admit(out, PrefillBudget(self.prompt_budget - len(out.scheduled)), chunked=False)


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
    """Static batching: whole prompts admitted only when nothing runs, then decoded to the end."""

    reserve_final_length = True

    def _schedule(self, out):
        if self.running:
            self._decodes(out)
        else:
            self._admit(out, PrefillBudget(self.prompt_budget), chunked=False)


POLICIES = {
    "sarathi": SarathiScheduler,
    "vllm": VllmScheduler,
    "orca": OrcaScheduler,
    "simple_chunking": SimpleChunkingScheduler,
    "faster_transformer": FasterTransformerScheduler,
}
