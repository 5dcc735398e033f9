"""The SLO-driven budget over a changing load: what the cost model predicted against what each step took, and
the budget it chose, step by step (the plots of docs/scheduling.md).

The engine runs with --tbt-slo-ms in this process on three phases of the bundled ShareGPT trace: a light
load, a burst well above capacity, then light again. Every step record (predicted time, actual time, time
limit, prefill tokens, decodes) goes to steps.csv; the plots need matplotlib.

    python -m bench.slo_timeline --model /tmp/minisarathi-study-model --out bench/out/slo-study/timeline \\
        --plots docs/plots
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
from pathlib import Path

from minisarathi.bench.targets import EngineTarget
from minisarathi.bench.workloads import WorkloadConfig, make_workload
from minisarathi.engine.engine import LLMEngine

PHASES = ((15.0, 0.5), (8.0, 4.0), (15.0, 0.5))   # (seconds, requests per second)


def phased_workload(trace_scale: float, max_model_len: int, seed: int) -> list:
    """Poisson arrivals at each phase's rate, one phase after the other; request ids stay unique."""
    specs, start = [], 0.0
    for i, (seconds, qps) in enumerate(PHASES):
        cfg = WorkloadConfig(num_requests=max(1, round(seconds * qps)), lengths="trace", trace_scale=trace_scale,
                             max_model_len=max_model_len, qps=qps, seed=seed + i)
        for spec in make_workload(cfg):
            specs.append(dataclasses.replace(spec, request_id=f"phase{i}-{spec.request_id}",
                                             arrival_time=start + spec.arrival_time))
        start += seconds
    return specs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tbt-slo-ms", type=float, default=300.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--trace-scale", type=float, default=0.125)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plots", type=Path, default=None, help="also copy the PNGs here")
    args = parser.parse_args(argv)

    engine = LLMEngine(args.model, tbt_slo_ms=args.tbt_slo_ms, chunk_size=8192, max_model_len=args.max_model_len)
    profiled = engine.cost_model.summary()["coefficients"]
    target = EngineTarget(engine)
    target.warmup()
    first = len(engine.step_records)
    specs = phased_workload(args.trace_scale, args.max_model_len, args.seed)
    result = target.run(specs, time_limit=sum(s for s, _ in PHASES) + 120, label="timeline")
    records = engine.step_records[first:]
    t0 = records[0].start_time
    rows = [{"t": r.start_time - t0, "step_time": r.step_time, "predicted_time": r.predicted_time,
             "time_limit": r.time_limit, "prefill_tokens": r.num_prefill_tokens, "decodes": r.num_decode_tokens,
             "admission_stop": r.admission_stop, "overloaded": r.overloaded} for r in records]
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "steps.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    stats = engine.stats()
    summary = {"tbt_slo_ms": args.tbt_slo_ms, "phases": PHASES, "requests": len(specs),
               "completed": sum(r.completed for r in result.requests), "steps": len(rows),
               "profiled_coefficients": profiled, "cost_model": stats["cost_model"], "tbt_slo": stats["tbt_slo"],
               "steps_over_target": sum(r["step_time"] > args.tbt_slo_ms / 1e3 for r in rows)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    for path in plot(rows, args.tbt_slo_ms / 1e3, args.out):
        print(f"plot: {path}")
        if args.plots:
            args.plots.mkdir(parents=True, exist_ok=True)
            (args.plots / path.name).write_bytes(path.read_bytes())
    return 0


def plot(rows: list[dict], target: float, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    predicted = [r for r in rows if r["predicted_time"] is not None]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter([r["predicted_time"] * 1e3 for r in predicted], [r["step_time"] * 1e3 for r in predicted], s=4)
    top = max(max(r["step_time"] for r in rows), target) * 1e3 * 1.05
    ax.plot([0, top], [0, top], color="grey", lw=0.8, label="actual = predicted")
    ax.axhline(target * 1e3, color="tab:red", lw=0.8, ls="--", label="TBT target")
    ax.set(xlabel="predicted step time (ms)", ylabel="actual step time (ms)", xlim=(0, top), ylim=(0, top),
           title="cost model: predicted vs actual")
    ax.legend(fontsize=8)
    scatter = out / "slo_predicted_vs_actual.png"
    fig.tight_layout()
    fig.savefig(scatter, dpi=110)
    plt.close(fig)

    fig, (time_ax, work_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    t = [r["t"] for r in rows]
    time_ax.plot(t, [r["step_time"] * 1e3 for r in rows], lw=0.8, label="actual")
    time_ax.plot(t, [None if r["predicted_time"] is None else r["predicted_time"] * 1e3 for r in rows], lw=0.8,
                 label="predicted")
    time_ax.plot(t, [None if r["time_limit"] is None else r["time_limit"] * 1e3 for r in rows], lw=0.8,
                 label="budget (target - margin)")
    time_ax.axhline(target * 1e3, color="tab:red", lw=0.8, ls="--", label="target")
    time_ax.set(ylabel="step time (ms)", title="SLO-driven budget under a changing load")
    time_ax.legend(fontsize=8, loc="upper right")
    work_ax.plot(t, [r["prefill_tokens"] for r in rows], lw=0.8, label="prefill tokens")
    work_ax.plot(t, [r["decodes"] for r in rows], lw=0.8, label="decodes")
    over = [r["t"] for r in rows if r["overloaded"]]
    if over:
        work_ax.scatter(over, [0] * len(over), s=6, color="tab:red", label="overloaded")
    work_ax.set(xlabel="time (s)", ylabel="per step")
    work_ax.legend(fontsize=8, loc="upper right")
    timeline = out / "slo_budget_timeline.png"
    fig.tight_layout()
    fig.savefig(timeline, dpi=110)
    plt.close(fig)
    return [scatter, timeline]


if __name__ == "__main__":
    raise SystemExit(main())
