"""The engine's record of each step: what it ran and how long each part took (benchmarks and logs read it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class StepRecord:
    start_time: float  # time.monotonic() at the start of the step
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    schedule_time: float  # scheduling and batch building
    execution_time: float  # model forward + sampling: issuing them, plus ids_wait_time
    step_time: float  # the whole step() call, bookkeeping and outputs included
    prefill_attention: int  # the cost model's attention features (cost_model.StepShape)
    decode_attention: int
    predicted_time: float | None  # the cost model's prediction of step_time (None before its first fit)
    time_limit: float | None  # tbt_slo_ms mode: what the predicted time could reach (target - margin)
    admission_stop: str | None  # why no further waiting request was admitted (scheduler.ADMISSION_STOPS)
    overloaded: bool  # tbt_slo_ms mode: the decodes alone were predicted over the target
    # Host against device: host_time + ids_wait_time = step_time. ids_wait_time is the step() call's wait for
    # sampled ids on the host (with overlap the previous step's, while this step's forward runs on the
    # device); on a synchronous backend (NumPy, the emulator) the compute is host time and the wait is about
    # 0.
    host_time: float
    ids_wait_time: float
    # structured outputs: computing the constrained rows' bitmasks and applying them (part of execution_time)
    mask_time: float = 0.0


class StepLog:
    """The engine's StepRecords, indexed by step number since the engine started, keeping at least the latest
    `keep` (a server runs for ever). Because indices never shift, `log[n:]` with `n = len(log)` taken earlier
    still means "the steps since then"; records older than the latest `keep` may be gone from it."""

    def __init__(self, keep: int):
        self.keep = keep
        self._records: list[StepRecord] = []
        self._num_dropped = 0

    def append(self, record: StepRecord) -> None:
        self._records.append(record)
        if len(self._records) >= 2 * self.keep:  # drop in bulk: amortized O(1) per step
            del self._records[: self.keep]
            self._num_dropped += self.keep

    def __len__(self) -> int:
        return self._num_dropped + len(self._records)

    def __iter__(self):
        return iter(self._records)

    def __getitem__(self, key: int | slice) -> StepRecord | list[StepRecord]:
        steps = range(len(self))[key]  # step numbers: negative indices and slices resolved
        if isinstance(steps, int):
            if steps < self._num_dropped:
                raise IndexError(f"step record {steps} was dropped (the log keeps the latest {self.keep})")
            return self._records[steps - self._num_dropped]
        return [self._records[i - self._num_dropped] for i in steps if i >= self._num_dropped]


STEP_RECORDS_KEPT = 50_000  # the log holds this to twice this many records, a bounded memory


def step_time_summary(records: list[StepRecord]) -> dict:
    """The step times (ms) of `records`: percentiles of all, the median of the decode-only steps by their
    number of sequences, and of the steps with prefill tokens ([count, median] each). Under a steady load the
    decode steps with fewer sequences than usual and the prefill steps are those of requests finishing and
    arriving (docs/reliability.md, "Hostile clients")."""
    if not records:
        return {"steps": 0}
    ms = np.array([r.step_time for r in records]) * 1000  # float64[N]
    num_seqs = np.array([r.num_seqs for r in records])  # int64[N]
    prefill = np.array([r.num_prefill_tokens > 0 for r in records])
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])

    def count_median(rows) -> list:
        return [int(rows.sum()), round(float(np.median(ms[rows])), 3)]

    return {
        "steps": len(records),
        "p50_ms": round(float(p50), 3),
        "p90_ms": round(float(p90), 3),
        "p99_ms": round(float(p99), 3),
        "max_ms": round(float(ms.max()), 3),
        "decode_by_num_seqs": {
            str(n): count_median(~prefill & (num_seqs == n)) for n in np.unique(num_seqs[~prefill]).tolist()
        },
        "prefill": count_median(prefill) if prefill.any() else [0, None],
    }
