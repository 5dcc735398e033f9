"""Workload generators: reproducible, and following their distributions (fixed seeds, large samples)."""

import csv
from collections import Counter

import numpy as np
import pytest

from minisarathi.bench.workloads import (
    SHAREGPT_TRACE,
    WorkloadConfig,
    arrival_times,
    fit_to_max_len,
    make_workload,
    read_trace_lengths,
    request_lengths,
)


def gaps(cfg, seed=1):
    return np.diff(arrival_times(cfg, np.random.default_rng(seed)))


def test_same_config_same_workload_and_seed_changes_it():
    cfg = WorkloadConfig(num_requests=50, lengths="trace", max_model_len=1024, qps=3.0, seed=7)
    a, b = make_workload(cfg), make_workload(cfg)
    assert a == b
    c = make_workload(WorkloadConfig(num_requests=50, lengths="trace", max_model_len=1024, qps=3.0, seed=8))
    assert [s.prompt_token_ids for s in a] != [s.prompt_token_ids for s in c]
    for spec in a:
        assert len(spec.prompt_token_ids) + spec.max_tokens <= 1024
        assert min(spec.prompt_token_ids) >= 3 and max(spec.prompt_token_ids) < 512
    assert a[0].arrival_time == 0.0
    assert all(x.arrival_time <= y.arrival_time for x, y in zip(a, a[1:]))


def test_poisson_gaps_are_exponential_clipped_at_three_means():
    cfg = WorkloadConfig(num_requests=40001, arrivals="poisson", qps=4.0)
    g = gaps(cfg)
    mean = 1 / 4.0
    assert g.max() == pytest.approx(3 * mean)  # the clip is reached, never passed (up to cumsum rounding)
    # E[min(X, 3m)] for X ~ Exp(mean m) is m (1 - e^-3).
    assert g.mean() == pytest.approx(mean * (1 - np.exp(-3)), rel=0.02)
    assert np.mean(np.isclose(g, 3 * mean)) == pytest.approx(np.exp(-3), abs=0.005)


def test_gamma_gaps_have_the_asked_mean_and_cv():
    for cv in (0.5, 2.0):
        g = gaps(WorkloadConfig(num_requests=80001, arrivals="gamma", qps=2.0, cv=cv))
        assert g.mean() == pytest.approx(0.5, rel=0.03)
        assert g.std() / g.mean() == pytest.approx(cv, rel=0.05)


def test_static_arrivals_all_at_zero():
    assert (
        arrival_times(WorkloadConfig(num_requests=10, arrivals="static"), np.random.default_rng(0)) == 0
    ).all()


def test_trace_arrivals_read_relative_to_the_first(tmp_path):
    path = tmp_path / "arrivals.csv"
    path.write_text("arrived_at\n10.0\n10.5\n12.0\n13.0\n")
    cfg = WorkloadConfig(num_requests=3, arrivals="trace", arrival_trace=str(path))
    assert arrival_times(cfg, np.random.default_rng(0)).tolist() == [0.0, 0.5, 2.0]
    with pytest.raises(ValueError, match="arrival_trace"):
        arrival_times(
            WorkloadConfig(num_requests=5, arrivals="trace", arrival_trace=str(path)),
            np.random.default_rng(0),
        )


def test_zipf_totals_follow_a_power_law():
    cfg = WorkloadConfig(
        num_requests=100000,
        lengths="zipf",
        min_total_tokens=20,
        max_total_tokens=119,
        zipf_theta=0.8,
        pd_ratio=3.0,
        max_model_len=4096,
    )
    prompt, decode = request_lengths(cfg, np.random.default_rng(3))
    total = prompt + decode
    assert total.min() == 20 and total.max() == 119
    counts = Counter(total.tolist())
    ranks = np.arange(1, 11)
    freq = np.array([counts[20 + k - 1] for k in ranks], dtype=float)
    slope = np.polyfit(np.log(ranks), np.log(freq), 1)[0]
    assert slope == pytest.approx(-0.8, abs=0.05)
    assert np.allclose(decode, np.round(total / 4), atol=0.5)  # prefill:decode = 3


def test_uniform_totals_are_uniform_and_split_by_the_ratio():
    cfg = WorkloadConfig(
        num_requests=50000,
        lengths="uniform",
        min_total_tokens=10,
        max_total_tokens=209,
        pd_ratio=1.0,
        max_model_len=4096,
    )
    prompt, decode = request_lengths(cfg, np.random.default_rng(4))
    total = prompt + decode
    assert total.min() == 10 and total.max() == 209
    assert total.mean() == pytest.approx(109.5, rel=0.01)
    counts = np.bincount(total - 10)
    assert counts.std() / counts.mean() < 0.1  # 200 bins of ~250: flat
    assert (np.abs(prompt - decode) <= 1).all()


def test_fixed_lengths():
    prompt, decode = request_lengths(
        WorkloadConfig(num_requests=3, lengths="fixed", prompt_len=7, decode_len=5), np.random.default_rng(0)
    )
    assert prompt.tolist() == [7, 7, 7] and decode.tolist() == [5, 5, 5]


def test_fit_to_max_len_scales_long_rows_proportionally():
    prompt, decode = fit_to_max_len(
        np.array([1000, 3000, 300, 1, 5000]), np.array([1000, 10, 200, 5000, 1]), 1000
    )
    assert prompt.tolist() == [500, 996, 300, 1, 999]
    assert decode.tolist() == [500, 3, 200, 999, 1]
    # 1000 - ceil(1000 * 1000/2000) and 3000 - ceil(2010 * 3000/3010) = 3000 - 2004; short rows untouched.


def test_bundled_trace_rows_replayed_and_scaled():
    raw_prompt, raw_decode = read_trace_lengths(SHAREGPT_TRACE)
    with open(SHAREGPT_TRACE) as f:
        assert sum(1 for _ in csv.reader(f)) - 1 == len(raw_prompt) == 30731
    rows = set(zip(raw_prompt.astype(int).tolist(), raw_decode.astype(int).tolist()))
    big = WorkloadConfig(num_requests=500, lengths="trace", max_model_len=10**6)
    prompt, decode = request_lengths(big, np.random.default_rng(5))
    assert set(zip(prompt.tolist(), decode.tolist())) <= rows  # unscaled: real rows
    half = WorkloadConfig(num_requests=500, lengths="trace", max_model_len=10**6, trace_scale=0.5)
    p2, d2 = request_lengths(half, np.random.default_rng(5))  # same rows, halved
    assert np.abs(p2 - prompt / 2).max() <= 0.5 and np.abs(d2 - decode / 2).max() <= 0.5
    cut = WorkloadConfig(num_requests=2000, lengths="trace", max_model_len=1024)
    p3, d3 = request_lengths(cut, np.random.default_rng(5))
    assert ((p3 + d3) <= 1024).all() and (p3 >= 1).all() and (d3 >= 1).all()
    assert np.median(p3 / d3) == pytest.approx(np.median(raw_prompt / raw_decode), rel=0.25)


@pytest.mark.parametrize(
    "field, value",
    [
        ("lengths", "normal"),
        ("arrivals", "burst"),
        ("num_requests", 0),
        ("qps", 0.0),
        ("cv", -1.0),
        ("max_model_len", 1),
        ("min_total_tokens", 600),
        ("trace_scale", 0),
        ("long_fraction", 1.5),
        ("long_factor", 0.5),
        ("high_priority_fraction", -0.1),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        WorkloadConfig(**{field: value})


def test_long_prompts_and_priorities_are_tagged():
    base = dict(num_requests=400, lengths="fixed", prompt_len=50, decode_len=10, max_model_len=1024, seed=3)
    plain = make_workload(WorkloadConfig(**base))
    specs = make_workload(
        WorkloadConfig(**base, long_fraction=0.05, long_factor=16, high_priority_fraction=0.25)
    )
    assert [s.arrival_time for s in specs] == [s.arrival_time for s in plain]  # arrivals untouched
    long = [s for s in specs if "long" in s.group.split("+")]
    assert 0.02 < len(long) / len(specs) < 0.09
    assert all(len(s.prompt_token_ids) == 800 for s in long)  # 16 x the median (50)
    assert all(len(s.prompt_token_ids) == 50 for s in specs if "short" in s.group)
    high = [s for s in specs if s.group.endswith("high")]
    assert 0.18 < len(high) / len(specs) < 0.32 and all(s.priority == 0 for s in high)
    assert all(s.priority == 1 for s in specs if s.group.endswith("low"))
    assert all(s.group == "" and s.priority == 0 for s in plain)
    capped = make_workload(WorkloadConfig(**{**base, "max_model_len": 300}, long_fraction=0.5))
    assert max(len(s.prompt_token_ids) + s.max_tokens for s in capped) <= 300
