"""Overlap of the host with the device (docs/performance.md, "Overlap of the host with the device").

A step() call launches step N+1 and returns step N's outputs: it schedules N+1 and issues its forward (whose
decode inputs are step N's ids, read on the device), then waits for step N's ids and updates N's sequences
while the device runs N+1, and then issues N+1's sampling, without the rows of sequences that N finished.
Structured outputs' masks for N+1 are computed there, before its sampling: after N's tokens reached the
matchers, while the device still runs N+1's forward (so the cost model adds only what that forward does not
hide).

Meanwhile a sequence may change under its token in flight: aborted (the token is dropped), preempted or
paused (it still takes the token and, if that finishes it, leaves its queue), or finished by step N (its
row of N+1 is not sampled, so it draws no random number). One whose token in flight is its last by length
has a full KV cache, so the scheduler gives it no further step.

Overlap is a mixin over the synchronous LLMEngine: engine.py composes OverlappingEngine from the two, and
LLMEngine.__new__ picks it where overlaps() says. It overrides _run_step (the order of a step's phases),
_make_batch and _decode_token (inputs from the device), _update and _append_token (the changes above), and
the two "is there work" queries (a step in flight is work).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from minisarathi.backends.devices import resolve_device
from minisarathi.batch import Batch
from minisarathi.config import EngineConfig
from minisarathi.engine.sequence import Sequence, SequenceStatus
from minisarathi.sampler import SamplerOutput


def overlaps(config: EngineConfig) -> bool:
    """config.overlap; None: where the forward runs asynchronously, the CUDA backend on a GPU. The NumPy
    backend and the emulator compute on the host while the forward is issued, so there is nothing to overlap;
    tensor parallelism's ranks take their input ids from the host, and so do speculation's drafts."""
    if config.overlap is not None or config.speculative_config:
        return bool(config.overlap)
    return config.tensor_parallel_size == 1 and resolve_device(config.device) == "cuda"


@dataclass
class OverlapBatch(Batch):
    """A batch whose decode tokens the previous step sampled on the device, not yet known on the host: row
    previous_rows[i] of input_ids (0 on the host) takes previous_ids[previous_sources[i]] there (every
    backend's upload_batch does it)."""

    previous_ids: Any = None  # int32/int64[N] on the device: the previous step's ids
    previous_rows: np.ndarray | None = None  # int32[P]
    previous_sources: np.ndarray | None = None  # int32[P]


class Overlap:
    overlap = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_flight = None  # the Step launched, its ids not yet on the host
        self._in_flight_rows: dict[Sequence, int] = {}  # its samplers' rows of sampled.token_ids
        self._from_device: list[tuple[int, int]] = []  # the batch being built: (its row, in-flight row)

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or self._in_flight is not None

    def has_work(self) -> bool:
        return super().has_work() or self._in_flight is not None

    def _run_step(self, start: float) -> list:
        launched = self._launch(start)
        previous, self._in_flight, self._in_flight_rows = self._in_flight, None, {}
        ids_wait, outputs = 0.0, []
        if previous is not None:
            ids_wait, outputs = self._complete(previous)
        if launched is None:
            return outputs
        if any(seq.is_finished for seq in launched.samplers):  # finished by `previous`, or aborted
            keep = [row for row, seq in enumerate(launched.samplers) if not seq.is_finished]
            launched.logits, launched.samplers = launched.logits[keep], [launched.samplers[r] for r in keep]
        self._sample(launched)
        self._in_flight = launched
        self._in_flight_rows = {seq: row for row, seq in enumerate(launched.samplers)}
        self._record(launched, start, ids_wait)
        return outputs

    def _make_batch(self, scheduled: dict[Sequence, int], starts: list[int]):
        self._from_device = []
        batch, samplers, num_prefill = super()._make_batch(scheduled, starts)
        if self._from_device:
            rows, sources = zip(*self._from_device)
            batch = OverlapBatch(
                **vars(batch),
                previous_ids=self._in_flight.sampled.token_ids,
                previous_rows=np.array(rows, np.int32),  # int32[P]
                previous_sources=np.array(sources, np.int32),
            )  # int32[P]
        return batch, samplers, num_prefill

    def _decode_token(self, seq: Sequence, row: int) -> int:
        source = self._in_flight_rows.get(seq)
        if source is None:
            return super()._decode_token(seq, row)
        self._from_device.append((row, source))  # sampled by the step in flight: taken on the device
        return 0

    def _update(self, step, sampled: SamplerOutput, now: float) -> list:
        if any(seq.is_finished for seq in step.samplers):  # aborted while their tokens were in flight
            keep = [row for row, seq in enumerate(step.samplers) if not seq.is_finished]
            step.samplers = [step.samplers[r] for r in keep]
            sampled = SamplerOutput(
                sampled.token_ids[keep], [sampled.logprobs[r] for r in keep], [sampled.ranks[r] for r in keep]
            )
        return super()._update(step, sampled, now)

    def _append_token(self, seq: Sequence, token: int, sampled: SamplerOutput, row: int, now: float) -> bool:
        queued = seq.status is not SequenceStatus.RUNNING  # preempted or paused while its token flew
        done = super()._append_token(seq, token, sampled, row, now)
        if done and queued:  # it leaves its queue and frees its blocks
            scheduler = self.scheduler
            if seq in scheduler.waiting:
                scheduler.waiting.remove(seq)
            elif seq in scheduler.paused:
                scheduler.paused.remove(seq)
            self.block_manager.free(seq)
        return done
