"""Capacity: the highest Poisson QPS a system serves within the SLOs (Sarathi-Serve's definition).

A trial at a QPS passes when P99 TBT <= the TBT SLO and the median scheduling delay <= its bound (default
2 s) and every request completed within the trial's time limit. The search brackets the threshold by
doubling or halving from a start QPS, then bisects until the bracket is within a relative granularity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Slo:
    p99_tbt: float  # seconds
    median_scheduling_delay: float = 2.0

    def __post_init__(self):
        for name in ("p99_tbt", "median_scheduling_delay"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)!r}")


class SloWatch:
    """While a trial runs: is it already sure to fail? Yes once more than half of its requests waited
    longer than the delay bound (the median will exceed it), or once more TBT gaps exceed the SLO than
    P99 allows: NumPy's P99 of n gaps is at least the element at floor(0.99 (n - 1)) in sorted order,
    which is over the SLO once n - floor(0.99 (n - 1)) gaps are."""

    def __init__(self, slo: Slo, num_requests: int, num_gaps: int):
        self.slo = slo
        self.max_late = num_requests // 2
        self.max_gaps_over = num_gaps - int(0.99 * (num_gaps - 1)) - 1 if num_gaps else None

    def verdict(self, num_late: int, num_gaps_over: int) -> str | None:
        if num_late > self.max_late:
            return f"median scheduling delay over {self.slo.median_scheduling_delay:g} s"
        if self.max_gaps_over is not None and num_gaps_over > self.max_gaps_over:
            return f"P99 TBT over {self.slo.p99_tbt * 1e3:.1f} ms"
        return None


@dataclass
class Trial:
    qps: float
    p99_tbt: float | None
    median_scheduling_delay: float | None
    completed: int
    requests: int
    passed: bool
    stopped: str | None = None  # why the trial ended early (then the figures cover what finished)

    def describe(self) -> str:
        if self.stopped:  # the figures would cover only the requests that finished before the stop
            return f"qps {self.qps:8.3f}: stopped early, {self.stopped} -> FAIL"
        tbt = "-" if self.p99_tbt is None else f"{self.p99_tbt * 1e3:.1f} ms"
        delay = "-" if self.median_scheduling_delay is None else f"{self.median_scheduling_delay:.2f} s"
        verdict = "pass" if self.passed else "FAIL"
        return (
            f"qps {self.qps:8.3f}: P99 TBT {tbt:>10}, median sched. delay {delay:>8}, "
            f"completed {self.completed}/{self.requests} -> {verdict}"
        )


def judge(qps: float, metrics: dict, slo: Slo) -> Trial:
    """A trial from compute_metrics() output. Remote targets can't see scheduling: TTFT stands in for it."""
    tbt = metrics["tbt"]["p99"]
    delay = metrics["scheduling_delay"]["p50"]
    if metrics["scheduling_delay"]["count"] == 0:
        delay = metrics["ttft"]["p50"]
    passed = (
        metrics["completed"] == metrics["requests"]
        and tbt is not None
        and tbt <= slo.p99_tbt
        and delay is not None
        and delay <= slo.median_scheduling_delay
    )
    return Trial(qps, tbt, delay, metrics["completed"], metrics["requests"], passed, metrics.get("stopped"))


def find_capacity(
    run_trial: Callable[[float], Trial],
    start_qps: float = 1.0,
    granularity: float = 0.1,
    max_trials: int = 16,
    on_trial: Callable[[Trial], None] = lambda t: None,
) -> tuple[float, list[Trial]]:
    """(capacity QPS, trail of trials). Capacity is the highest passing QPS found, 0.0 if none passed."""
    if not start_qps > 0:
        raise ValueError(f"start_qps must be positive, got {start_qps!r}")
    if not 0 < granularity < 1:
        raise ValueError(f"granularity must be in (0, 1), got {granularity!r}")
    if max_trials < 1:
        raise ValueError(f"max_trials must be >= 1, got {max_trials!r}")
    trail: list[Trial] = []

    def trial(qps: float) -> bool:
        t = run_trial(qps)
        trail.append(t)
        on_trial(t)
        return t.passed

    passed_qps, failed_qps = None, None
    qps = start_qps
    while len(trail) < max_trials and (passed_qps is None or failed_qps is None):
        if trial(qps):
            passed_qps, qps = qps, qps * 2
        else:
            failed_qps, qps = qps, qps / 2
    while (
        len(trail) < max_trials
        and passed_qps is not None
        and failed_qps is not None
        and failed_qps - passed_qps > granularity * passed_qps
    ):
        mid = (passed_qps + failed_qps) / 2
        if trial(mid):
            passed_qps = mid
        else:
            failed_qps = mid
    return (passed_qps or 0.0), trail
