"""Prometheus metrics under vLLM's names with a `minisarathi:` prefix (one rename adapts a vLLM dashboard).

Two sources. Finished requests of either door (Hub.report_finished) feed the request counters and
histograms, when they finish: `prompt_tokens_total` and `generation_tokens_total` count each finished
request's tokens (aborted ones included). The engine's state is read at scrape time, on the engine thread
between steps: the gauges, the engine's own counters (preemptions, prefix-cache queries and hits), and
the steps since the last scrape for `iteration_tokens_total` (the engine keeps its latest 50,000 steps).
A third, read at scrape time on the loop: the server's security counters (failed auths, paused requests,
unauthenticated connections) and, with key_labels (`--metrics-key-labels`), per-key quotas labelled by the
names in the keys file: /metrics is open, and would otherwise tell anyone every key's name and usage.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minisarathi.engine.cost_model import ERROR_BUCKETS
from minisarathi.server.request_log import FinishedRequest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "minisarathi:"

# vLLM's latency buckets, extended down to 0.5 ms: a small model on a CPU has sub-10 ms steps.
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_TOKEN_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


def _one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class Metrics:
    def __init__(self, model_name: str, max_model_len: int, token_budget: int):
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name}
        self._token_budget = token_budget
        r, names = self.registry, ["model_name"]

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=r).labels(model_name)

        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", names, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of finished requests.", names, registry=r
        ).labels(model_name)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            [*names, "finished_reason"],
            registry=r,
        )
        token_buckets = _one_two_five(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Between consecutive tokens of a request.", _TOKEN_LATENCY_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS
        )
        self.decode = histogram("request_decode_time_seconds", "First token to finish.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", token_buckets
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens per engine step (prefill chunks plus decodes): where chunked prefill shows.",
            token_buckets,
        )
        self.step_prediction = histogram(
            "step_time_prediction_ratio",
            "Engine steps by the cost model's predicted over actual step time.",
            ERROR_BUCKETS,
        )
        self._engine_state: dict = {}
        self._next_step = 0
        self.registry.register(_EngineCollector(self))

    def watch_hub(self, hub, key_labels: bool = False) -> None:
        """Export `hub.security_stats()` at every scrape (Hub, minisarathi/server/hub.py), its per-key
        counters only with key_labels."""
        self.registry.register(_SecurityCollector(hub, self._labels, key_labels))

    def request_finished(self, r: FinishedRequest) -> None:
        self.request_success.labels(self._labels["model_name"], r.finish_reason).inc()
        self.prompt_tokens.inc(r.prompt_tokens)
        self.generation_tokens.inc(r.completion_tokens)
        self.request_prompt_tokens.observe(r.prompt_tokens)
        self.request_generation_tokens.observe(r.completion_tokens)
        m = r.metrics
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            self.prefill.observe(m.first_token_time - (m.first_scheduled_time or m.arrival_time))
            self.decode.observe(m.finished_time - m.first_token_time)
        times = list(m.token_times)
        for earlier, later in zip(times, times[1:]):
            self.itl.observe(later - earlier)

    def read_engine(self, engine) -> None:
        """On the engine thread: the state the scrape reports, and the steps since the last scrape."""
        steps = engine.step_records[self._next_step :]
        self._next_step = len(engine.step_records)
        for step in steps:
            self.iteration_tokens.observe(step.num_prefill_tokens + step.num_decode_tokens)
            if step.predicted_time is not None and step.step_time > 0:
                self.step_prediction.observe(step.predicted_time / step.step_time)
        self._engine_state = {**engine.stats(), "gpu_memory_used_bytes": _gpu_memory_used(engine)}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def collect(self):
        state, labels = self._metrics._engine_state, self._metrics._labels
        if not state:
            return

        def family(kind, name, doc, value):
            metric = kind(PREFIX + name, doc, labels=list(labels))
            metric.add_metric(list(labels.values()), value)
            return metric

        yield family(
            GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", state["running"]
        )
        yield family(
            GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", state["waiting"]
        )
        yield family(
            GaugeMetricFamily,
            "kv_cache_usage_perc",
            "Fraction of KV blocks in use (0 to 1).",
            state["kv_usage"],
        )
        yield family(
            GaugeMetricFamily,
            "scheduler_token_budget",
            "Tokens per engine step at most (chunk_size).",
            self._metrics._token_budget,
        )
        if state["gpu_memory_used_bytes"] is not None:
            yield family(
                GaugeMetricFamily,
                "gpu_memory_used_bytes",
                "Device memory held by the engine's pool.",
                state["gpu_memory_used_bytes"],
            )
        yield family(
            CounterMetricFamily, "num_preemptions", "Preemptions since start.", state["num_preemptions"]
        )
        yield family(
            CounterMetricFamily,
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            state["prefix_cache_queries"],
        )
        yield family(
            CounterMetricFamily,
            "prefix_cache_hits",
            "Of them, tokens found in the cache.",
            state["prefix_cache_hits"],
        )
        coefficients = state["cost_model"]["coefficients"]
        if coefficients is not None:
            metric = GaugeMetricFamily(
                PREFIX + "cost_model_coefficient_seconds",
                "The step cost model's seconds per unit of each feature (docs/scheduling.md).",
                labels=[*labels, "feature"],
            )
            for feature, value in coefficients.items():
                metric.add_metric([*labels.values(), feature], value)
            yield metric
        slo = state["tbt_slo"]
        if slo is not None:
            yield family(
                GaugeMetricFamily,
                "tbt_slo_target_seconds",
                "The TBT target (tbt_slo_ms).",
                slo["target_ms"] / 1e3,
            )
            yield family(
                GaugeMetricFamily,
                "tbt_slo_margin_seconds",
                "The safety margin below the target.",
                slo["margin_ms"] / 1e3,
            )
            yield family(
                GaugeMetricFamily,
                "tbt_slo_overloaded",
                "1 while the decodes alone are predicted over the target (new prompts wait).",
                int(slo["overloaded"]),
            )
            yield family(
                CounterMetricFamily,
                "tbt_slo_overloaded_steps",
                "Steps run overloaded.",
                slo["overloaded_steps"],
            )
        spec = state.get("spec_decode")  # vLLM's spec_decode counters (engine/speculative.py)
        if spec is not None:
            for name, doc in (
                ("num_drafts", "Verification steps of draft tokens (one per sequence and step)."),
                ("num_draft_tokens", "Draft tokens proposed."),
                ("num_accepted_tokens", "Draft tokens accepted."),
            ):
                yield family(CounterMetricFamily, "spec_decode_" + name, doc, spec[name])


class _SecurityCollector:
    def __init__(self, hub, labels: dict, key_labels: bool):
        self._hub = hub
        self._labels = labels
        self._key_labels = key_labels

    def collect(self):
        state, names, values = self._hub.security_stats(), list(self._labels), list(self._labels.values())
        for kind, name, doc, value in (
            (
                CounterMetricFamily,
                "auth_failures",
                "Failed authentications (both doors).",
                state["auth_failures"],
            ),
            (
                GaugeMetricFamily,
                "unauthenticated_connections",
                "msgpack connections not yet authenticated.",
                state["unauthenticated_connections"],
            ),
            (
                CounterMetricFamily,
                "requests_paused",
                "Requests paused because their client stopped reading.",
                state["paused"],
            ),
            (
                CounterMetricFamily,
                "unread_aborts",
                "Paused requests aborted after --unread-timeout.",
                state["unread_aborts"],
            ),
        ):
            metric = kind(PREFIX + name, doc, labels=names)
            metric.add_metric(values, value)
            yield metric
        if not self._key_labels:
            return
        per_key = state.get("keys", {})
        for field, kind, name, doc in (
            ("requests", CounterMetricFamily, "key_requests", "Requests admitted, by API key name."),
            ("rate_limited", CounterMetricFamily, "key_rate_limited", "Requests refused over quota, by key."),
            (
                "prompt_tokens",
                CounterMetricFamily,
                "key_prompt_tokens",
                "Prompt tokens of finished requests.",
            ),
            ("completion_tokens", CounterMetricFamily, "key_generation_tokens", "Generated tokens, by key."),
            ("inflight", GaugeMetricFamily, "key_requests_inflight", "Requests in flight, by key."),
        ):
            metric = kind(PREFIX + name, doc, labels=[*names, "key"])
            for key_name, counters in per_key.items():
                metric.add_metric([*values, key_name], counters[field])
            yield metric


def _gpu_memory_used(engine) -> int | None:
    """Bytes CuPy's memory pool holds for the engine (weights, KV cache, activations); None off the GPU."""
    xp = getattr(getattr(engine.model, "ops", None), "xp", None)
    if xp is None or xp.__name__ != "cupy":
        return None
    return int(xp.get_default_memory_pool().total_bytes())
