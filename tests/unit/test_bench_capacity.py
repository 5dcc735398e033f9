"""Capacity search on a fake system whose threshold is known."""

import numpy as np
import pytest

from minisarathi.bench.capacity import Slo, SloWatch, Trial, find_capacity, judge
from minisarathi.bench.metrics import RequestRecord, compute_metrics


def fake_metrics(p99_tbt, median_delay, completed=10, requests=10, remote=False):
    return {
        "completed": completed,
        "requests": requests,
        "tbt": {"p99": p99_tbt},
        "ttft": {"p50": median_delay},
        "scheduling_delay": {"count": 0 if remote else completed, "p50": None if remote else median_delay},
    }


def fake_system(threshold):
    """P99 TBT grows linearly with load and crosses the 37 ms SLO exactly at `threshold` qps."""
    slo = Slo(p99_tbt=0.037, median_scheduling_delay=2.0)
    seen = []

    def run_trial(qps):
        seen.append(qps)
        return judge(qps, fake_metrics(0.037 * qps / threshold, 0.1), slo)

    return run_trial, seen


@pytest.mark.parametrize("threshold, start", [(3.7, 1.0), (3.7, 10.0), (0.31, 1.0), (25.0, 0.5)])
def test_finds_a_known_threshold_within_the_granularity(threshold, start):
    run_trial, seen = fake_system(threshold)
    capacity, trail = find_capacity(run_trial, start_qps=start, granularity=0.05, max_trials=30)
    assert threshold / 1.05 <= capacity <= threshold
    assert [t.qps for t in trail] == seen
    passed = [t.qps for t in trail if t.passed]
    failed = [t.qps for t in trail if not t.passed]
    assert max(passed) == capacity and min(failed) > threshold


def test_trail_bracketing_then_bisection():
    run_trial, _ = fake_system(3.7)
    capacity, trail = find_capacity(run_trial, start_qps=1.0, granularity=0.1)
    assert [t.qps for t in trail] == [1.0, 2.0, 4.0, 3.0, 3.5, 3.75]
    assert capacity == 3.5


def test_nothing_passes_gives_zero_and_stops_at_max_trials():
    capacity, trail = find_capacity(lambda q: Trial(q, 1.0, 0.0, 1, 1, False), start_qps=1.0, max_trials=5)
    assert capacity == 0.0 and len(trail) == 5


def test_judge_checks_every_criterion():
    slo = Slo(p99_tbt=0.1, median_scheduling_delay=2.0)
    assert judge(1.0, fake_metrics(0.1, 2.0), slo).passed
    assert not judge(1.0, fake_metrics(0.11, 0.1), slo).passed  # TBT over the SLO
    assert not judge(1.0, fake_metrics(0.01, 2.5), slo).passed  # queueing
    assert not judge(1.0, fake_metrics(0.01, 0.1, completed=9), slo).passed  # timed out requests
    remote = judge(1.0, fake_metrics(0.01, 3.0, remote=True), slo)  # TTFT stands in
    assert not remote.passed and remote.median_scheduling_delay == 3.0
    assert "FAIL" in remote.describe()
    stopped = judge(1.0, fake_metrics(0.01, 0.1, completed=3) | {"stopped": "P99 TBT over 100 ms"}, slo)
    assert not stopped.passed and stopped.describe().endswith("stopped early, P99 TBT over 100 ms -> FAIL")


def test_judge_on_computed_metrics():
    requests = [
        RequestRecord(
            f"r{i}",
            4,
            arrival=i,
            first_scheduled=i + 0.5,
            token_times=[i + 1, i + 1.05, i + 1.1],
            finished=i + 1.1,
        )
        for i in range(4)
    ]
    trial = judge(2.0, compute_metrics(requests), Slo(p99_tbt=0.06))
    assert trial.passed and trial.p99_tbt == pytest.approx(0.05) and trial.median_scheduling_delay == 0.5


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"start_qps": 0}, "start_qps"),
        ({"granularity": 1.5}, "granularity"),
        ({"max_trials": 0}, "max_trials"),
    ],
)
def test_bad_search_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        find_capacity(lambda q: None, **kwargs)


def test_bad_slo():
    with pytest.raises(ValueError, match="p99_tbt"):
        Slo(p99_tbt=0)


@pytest.mark.parametrize("num_gaps", [1, 7, 100, 101, 2000, 12345])
def test_slo_watch_p99_threshold_is_exact(num_gaps):
    """The watch says 'fail' exactly when the gaps over the SLO already force NumPy's P99 over it."""
    slo = Slo(p99_tbt=1.0)
    watch = SloWatch(slo, num_requests=10, num_gaps=num_gaps)
    for over in range(num_gaps + 1):
        # The most forgiving outcome: the gaps over the SLO barely so, the ones to come all zero.
        gaps = np.r_[np.full(over, 1.0 + 1e-9), np.zeros(num_gaps - over)]
        sure = np.percentile(gaps, 99) > slo.p99_tbt
        assert (watch.verdict(0, over) is not None) == sure, over
        if over > 30:
            break


def test_slo_watch_median_delay_threshold():
    watch = SloWatch(Slo(p99_tbt=1.0, median_scheduling_delay=2.0), num_requests=9, num_gaps=0)
    assert watch.verdict(4, 0) is None and "scheduling delay" in watch.verdict(5, 0)
    even = SloWatch(Slo(p99_tbt=1.0), num_requests=10, num_gaps=0)
    assert even.verdict(5, 0) is None and even.verdict(6, 0) is not None
