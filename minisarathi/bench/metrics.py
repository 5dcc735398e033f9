"""Sarathi-Serve's serving metrics from request timelines and batch records; JSON, CSV and a printed table.

All times are seconds since the run started.
- TTFT: first token - arrival.            - TBT: gap between consecutive tokens of a request (a preempted
- e2e latency: finish - arrival;            request's stall lands in the gap after it, as users see it).
  normalized: e2e / output tokens.        - scheduling delay: first time scheduled - arrival.
- throughput: completed requests, their prompt and output tokens, per second from the first arrival to
  the last finish.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

STATS = ("mean", "p50", "p90", "p99", "max")


@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    arrival: float
    token_times: list[float] = field(default_factory=list)  # one per output token received
    first_scheduled: float | None = None  # None where the target can't see it (remote)
    finished: float | None = None  # None: did not complete (aborted, error, timeout)
    num_preemptions: int = 0
    error: str | None = None
    group: str = ""  # the workload's tag (RequestSpec.group)

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def completed(self) -> bool:
        return self.finished is not None and self.error is None


@dataclass
class BatchRecord:
    start: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    execution_time: float  # seconds: model forward + sampling

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


def summarize(values) -> dict:
    """count, mean, P50/P90/P99 (NumPy's linear interpolation) and max; None stats for no values."""
    values = np.asarray(list(values), dtype=np.float64)
    if len(values) == 0:
        return {"count": 0, **{s: None for s in STATS}}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {
        "count": len(values),
        "mean": float(values.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(values.max()),
    }


def compute_metrics(requests: list[RequestRecord], batches: list[BatchRecord] = ()) -> dict:
    done = [r for r in requests if r.completed]
    tbt = [gap for r in done for gap in np.diff(r.token_times)]
    scheduled = [r for r in done if r.first_scheduled is not None]
    duration = max((r.finished for r in done), default=0.0) - min((r.arrival for r in requests), default=0.0)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    return {
        "requests": len(requests),
        "completed": len(done),
        "duration_s": duration,
        "throughput": {
            "requests_per_s": per_second(len(done)),
            "prompt_tokens_per_s": per_second(sum(r.prompt_len for r in done)),
            "output_tokens_per_s": per_second(sum(r.output_len for r in done)),
        },
        "ttft": summarize(r.token_times[0] - r.arrival for r in done if r.token_times),
        "tbt": summarize(tbt),
        "e2e_latency": summarize(r.finished - r.arrival for r in done),
        "normalized_latency": summarize(
            (r.finished - r.arrival) / r.output_len for r in done if r.output_len
        ),
        "scheduling_delay": summarize(r.first_scheduled - r.arrival for r in scheduled),
        "preemptions": sum(r.num_preemptions for r in requests),
        "batch_tokens": summarize(b.num_tokens for b in batches),
        "batch_seqs": summarize(b.num_seqs for b in batches),
        "batch_execution_time": summarize(b.execution_time for b in batches),
    }


def metrics_by_group(requests: list[RequestRecord]) -> dict[str, dict]:
    """compute_metrics of each group of requests (by the workload's tags, "long+high" counting in both "long"
    and "high"); empty when the requests carry no tag. Batches are the whole run's: left out here."""
    tags = sorted({tag for r in requests if r.group for tag in r.group.split("+")})
    return {tag: compute_metrics([r for r in requests if tag in r.group.split("+")]) for tag in tags}


def request_row(r: RequestRecord) -> dict:
    gaps = np.diff(r.token_times)
    return {
        "request_id": r.request_id,
        "arrival": r.arrival,
        "prompt_len": r.prompt_len,
        "output_len": r.output_len,
        "completed": r.completed,
        "scheduling_delay": None if r.first_scheduled is None else r.first_scheduled - r.arrival,
        "ttft": r.token_times[0] - r.arrival if r.token_times else None,
        "e2e_latency": r.finished - r.arrival if r.finished is not None else None,
        "mean_tbt": float(gaps.mean()) if len(gaps) else None,
        "max_tbt": float(gaps.max()) if len(gaps) else None,
        "preemptions": r.num_preemptions,
        "error": r.error,
        "group": r.group,
    }


def save_run(
    out_dir: Path,
    label: str,
    info: dict,
    metrics: dict,
    requests: list[RequestRecord],
    batches: list[BatchRecord],
) -> Path:
    """<label>.json (everything, token times included) plus <label>_requests.csv and <label>_batches.csv."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{label}.json"
    path.write_text(
        json.dumps(
            {
                "info": info,
                "metrics": metrics,
                "requests": [asdict(r) for r in requests],
                "batches": [asdict(b) for b in batches],
            },
            indent=1,
        )
    )
    _write_csv(out_dir / f"{label}_requests.csv", [request_row(r) for r in requests])
    _write_csv(out_dir / f"{label}_batches.csv", [asdict(b) | {"num_tokens": b.num_tokens} for b in batches])
    return path


def load_run(path: Path) -> tuple[dict, list[RequestRecord], list[BatchRecord]]:
    data = json.loads(Path(path).read_text())
    return (
        data["info"],
        [RequestRecord(**r) for r in data["requests"]],
        [BatchRecord(**b) for b in data["batches"]],
    )


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


# Rows of the printed table: (label, metric key, stat, unit scale, unit).
TABLE_ROWS = (
    ("TTFT P50", "ttft", "p50", 1e3, "ms"),
    ("TTFT P99", "ttft", "p99", 1e3, "ms"),
    ("TBT P50", "tbt", "p50", 1e3, "ms"),
    ("TBT P99", "tbt", "p99", 1e3, "ms"),
    ("TBT max", "tbt", "max", 1e3, "ms"),
    ("e2e P50", "e2e_latency", "p50", 1, "s"),
    ("e2e P99", "e2e_latency", "p99", 1, "s"),
    ("norm. latency P50", "normalized_latency", "p50", 1e3, "ms/tok"),
    ("sched. delay P50", "scheduling_delay", "p50", 1e3, "ms"),
    ("sched. delay P99", "scheduling_delay", "p99", 1e3, "ms"),
    ("tokens/batch mean", "batch_tokens", "mean", 1, ""),
    ("batch time P50", "batch_execution_time", "p50", 1e3, "ms"),
)


def format_table(columns: dict[str, dict]) -> str:
    """Metrics of one or more runs side by side: {column label: compute_metrics() result}."""
    rows = [("", *columns)]
    rows.append(("completed", *(f"{m['completed']}/{m['requests']}" for m in columns.values())))
    for label, key, stat, scale, unit in TABLE_ROWS:
        name = f"{label} ({unit})" if unit else label
        rows.append((name, *(_fmt(m[key][stat], scale) for m in columns.values())))
    rows.append(("req/s", *(_fmt(m["throughput"]["requests_per_s"], 1) for m in columns.values())))
    rows.append(
        ("output tok/s", *(_fmt(m["throughput"]["output_tokens_per_s"], 1) for m in columns.values()))
    )
    rows.append(("preemptions", *(str(m["preemptions"]) for m in columns.values())))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    )


def _fmt(value, scale) -> str:
    if value is None:
        return "-"
    value *= scale
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
