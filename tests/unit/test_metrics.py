"""The Prometheus metrics' arithmetic on a stub engine: a finished request's timeline becomes exactly the
histogram observations it implies, and the GPU memory gauge reads CuPy's pool (only) on the CUDA backend."""

import types

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minisarathi.outputs import RequestMetrics  # noqa: E402
from minisarathi.server.metrics import Metrics  # noqa: E402
from minisarathi.server.request_log import FinishedRequest  # noqa: E402


def samples(metrics: Metrics) -> dict:
    text = metrics.exposition().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def stub_engine(xp=None, steps=()):
    stats = {
        "running": 2,
        "waiting": 1,
        "kv_usage": 0.25,
        "num_preemptions": 3,
        "prefix_cache_queries": 40,
        "prefix_cache_hits": 10,
        "cost_model": {"coefficients": {}, "fits": 0, "error_histogram": {}},
        "tbt_slo": None,
    }
    return types.SimpleNamespace(
        step_records=list(steps),
        stats=lambda: stats,
        model=types.SimpleNamespace(ops=types.SimpleNamespace(xp=xp)),
    )


def test_a_finished_request_gives_exactly_its_observations():
    metrics = Metrics("m", max_model_len=512, token_budget=64)
    timeline = RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.5,
        first_token_time=11.0,
        token_times=[11.0, 11.25, 11.75],
        finished_time=11.75,
    )
    metrics.request_finished(FinishedRequest("r", "http", "x", "p", 7, 0, 3, "stop", timeline))
    metrics.request_finished(FinishedRequest("a", "msgpack", "y", [1, 2], 2, 0, 1, "abort", None))
    s = samples(metrics)
    p = "minisarathi:"
    assert s[(p + "prompt_tokens_total", ())] == 9 and s[(p + "generation_tokens_total", ())] == 4
    assert s[(p + "request_success_total", (("finished_reason", "stop"),))] == 1
    assert s[(p + "request_success_total", (("finished_reason", "abort"),))] == 1
    assert s[(p + "time_to_first_token_seconds_sum", ())] == 1.0
    assert s[(p + "request_queue_time_seconds_sum", ())] == 0.5
    assert s[(p + "request_prefill_time_seconds_sum", ())] == 0.5
    assert s[(p + "request_decode_time_seconds_sum", ())] == 0.75
    assert s[(p + "e2e_request_latency_seconds_sum", ())] == 1.75
    assert s[(p + "inter_token_latency_seconds_count", ())] == 2
    assert s[(p + "inter_token_latency_seconds_sum", ())] == 0.75
    assert s[(p + "inter_token_latency_seconds_bucket", (("le", "0.3"),))] == 1  # 0.25 in, 0.5 above
    assert s[(p + "request_prompt_tokens_count", ())] == 2  # the aborted one counts its tokens too
    assert s[(p + "e2e_request_latency_seconds_count", ())] == 1  # but has no timeline to observe


def test_engine_state_iteration_tokens_and_the_gpu_gauge():
    def step(prefill, decode):
        # the fields of a StepRecord the scrape reads
        return types.SimpleNamespace(
            num_prefill_tokens=prefill, num_decode_tokens=decode, predicted_time=None, step_time=0.001
        )

    metrics = Metrics("m", max_model_len=512, token_budget=64)
    metrics.read_engine(stub_engine(steps=[step(64, 0), step(30, 4)]))
    s = samples(metrics)
    p = "minisarathi:"
    assert (
        s[(p + "iteration_tokens_total_sum", ())] == 98 and s[(p + "iteration_tokens_total_count", ())] == 2
    )
    assert s[(p + "num_requests_running", ())] == 2 and s[(p + "kv_cache_usage_perc", ())] == 0.25
    assert s[(p + "num_preemptions_total", ())] == 3 and s[(p + "prefix_cache_hits_total", ())] == 10
    assert s[(p + "scheduler_token_budget", ())] == 64
    assert (p + "gpu_memory_used_bytes", ()) not in s  # NumPy / emulator: host memory
    pool = types.SimpleNamespace(total_bytes=lambda: 123456789)
    cupy = types.SimpleNamespace(__name__="cupy", get_default_memory_pool=lambda: pool)
    metrics.read_engine(stub_engine(xp=cupy))
    assert samples(metrics)[(p + "gpu_memory_used_bytes", ())] == 123456789


def stub_hub():
    counters = {"requests": 3, "rate_limited": 1, "prompt_tokens": 30, "completion_tokens": 12, "inflight": 0}
    state = {"auth_failures": 2, "unauthenticated_connections": 0, "paused": 0, "unread_aborts": 0}
    return types.SimpleNamespace(security_stats=lambda: {**state, "keys": {"alice-laptop": dict(counters)}})


def test_key_names_and_usage_only_with_key_labels():
    """/metrics is open: by default it shows the server's counters but no key's name or usage."""
    anyone = Metrics("m", 64, 16)
    anyone.watch_hub(stub_hub())
    text = anyone.exposition().decode()
    assert "alice-laptop" not in text and "minisarathi:key_" not in text
    assert samples(anyone)[("minisarathi:auth_failures_total", ())] == 2
    labelled = Metrics("m", 64, 16)
    labelled.watch_hub(stub_hub(), key_labels=True)
    got = samples(labelled)
    key = (("key", "alice-laptop"),)
    assert got[("minisarathi:key_requests_total", key)] == 3
    assert got[("minisarathi:key_generation_tokens_total", key)] == 12
