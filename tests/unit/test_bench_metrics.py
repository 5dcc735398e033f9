"""Metrics on a hand-made timeline whose answers are known exactly."""

import csv

import pytest

from minisarathi.bench.metrics import (
    BatchRecord,
    RequestRecord,
    compute_metrics,
    format_table,
    load_run,
    metrics_by_group,
    save_run,
    summarize,
)


def timeline():
    return [
        RequestRecord(
            "a", prompt_len=10, arrival=0.0, first_scheduled=0.5, token_times=[1.0, 1.5, 2.5], finished=2.5
        ),
        # Preempted once: the stall shows up as the 1.75 s gap, as the user sees it.
        RequestRecord(
            "b",
            prompt_len=20,
            arrival=1.0,
            first_scheduled=1.0,
            token_times=[2.0, 3.75],
            finished=3.75,
            num_preemptions=1,
        ),
        RequestRecord("c", prompt_len=30, arrival=0.2, token_times=[0.9], error="aborted at the time limit"),
    ]


def batches():
    return [
        BatchRecord(0.5, 2, 30, 1, 0.25),
        BatchRecord(1.0, 3, 0, 3, 0.125),
        BatchRecord(1.5, 1, 0, 1, 0.125),
    ]


def test_request_metrics_known_answers():
    m = compute_metrics(timeline(), batches())
    assert (m["requests"], m["completed"], m["preemptions"]) == (3, 2, 1)
    assert m["ttft"] == {"count": 2, "mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0, "max": 1.0}
    # TBT gaps of completed requests: 0.5, 1.0, 1.75.
    assert m["tbt"]["count"] == 3
    assert m["tbt"]["mean"] == pytest.approx(3.25 / 3, abs=1e-12)
    assert m["tbt"]["p50"] == 1.0 and m["tbt"]["max"] == 1.75
    assert m["tbt"]["p90"] == pytest.approx(1.0 + 0.8 * 0.75, abs=1e-12)  # linear interpolation
    assert m["tbt"]["p99"] == pytest.approx(1.0 + 0.98 * 0.75, abs=1e-12)
    assert m["e2e_latency"]["p50"] == 2.625 and m["e2e_latency"]["max"] == 2.75
    assert m["normalized_latency"]["mean"] == pytest.approx((2.5 / 3 + 2.75 / 2) / 2, abs=1e-12)
    assert m["scheduling_delay"]["mean"] == 0.25 and m["scheduling_delay"]["max"] == 0.5
    # From the first arrival (0.0) to the last finish (3.75).
    assert m["duration_s"] == 3.75
    assert m["throughput"]["requests_per_s"] == pytest.approx(2 / 3.75, abs=1e-12)
    assert m["throughput"]["prompt_tokens_per_s"] == pytest.approx(30 / 3.75, abs=1e-12)
    assert m["throughput"]["output_tokens_per_s"] == pytest.approx(5 / 3.75, abs=1e-12)


def test_batch_metrics_known_answers():
    m = compute_metrics(timeline(), batches())
    assert (
        m["batch_tokens"]["mean"] == pytest.approx(35 / 3, abs=1e-12)
        and m["batch_tokens"]["max"] == 31
        and m["batch_tokens"]["p50"] == 3
    )
    assert m["batch_seqs"]["mean"] == 2.0
    assert m["batch_execution_time"]["p50"] == 0.125 and m["batch_execution_time"]["max"] == 0.25


def test_empty_inputs_give_none_not_errors():
    assert summarize([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    m = compute_metrics([RequestRecord("x", 5, 0.0, error="not sent")])
    assert m["completed"] == 0 and m["tbt"]["p99"] is None and m["throughput"]["requests_per_s"] is None
    assert "-" in format_table({"x": m})


def test_save_and_load_round_trip(tmp_path):
    m = compute_metrics(timeline(), batches())
    path = save_run(tmp_path, "sarathi", {"seed": 1}, m, timeline(), batches())
    info, requests, loaded_batches = load_run(path)
    assert info == {"seed": 1} and requests == timeline() and loaded_batches == batches()
    with open(tmp_path / "sarathi_requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["request_id"] for r in rows] == ["a", "b", "c"]
    assert float(rows[1]["max_tbt"]) == 1.75 and rows[2]["completed"] == "False"
    with open(tmp_path / "sarathi_batches.csv") as f:
        assert [int(r["num_tokens"]) for r in csv.DictReader(f)] == [31, 3, 1]


def test_table_has_one_column_per_run():
    m = compute_metrics(timeline(), batches())
    table = format_table({"sarathi-512": m, "vllm": m})
    header, completed, *_ = table.splitlines()
    assert "sarathi-512" in header and "vllm" in header
    assert completed.split()[1:] == ["2/3", "2/3"]
    assert "TBT P99 (ms)" in table and "1735" in table


def test_metrics_by_group():
    requests = timeline()
    assert metrics_by_group(requests) == {}
    requests[0].group, requests[1].group, requests[2].group = "short+high", "long+high", "short+low"
    groups = metrics_by_group(requests)
    assert sorted(groups) == ["high", "long", "low", "short"]
    assert groups["high"]["completed"] == 2 and groups["short"]["requests"] == 2
    assert groups["long"]["ttft"]["p50"] == 1.0 and groups["low"]["completed"] == 0
