"""`minisarathi bench run | capacity | compare | random-model`: the serving benchmark's command line."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from minisarathi.bench.capacity import Slo, find_capacity, judge
from minisarathi.bench.compare import capacity_table, policy_variants, tbt_ratio
from minisarathi.bench.metrics import compute_metrics, format_table, load_run, metrics_by_group, save_run
from minisarathi.bench.targets import (
    DECODE_PROBE_STEPS,
    EngineTarget,
    OpenAITarget,
    ServerTarget,
    measure_decode_step,
)
from minisarathi.bench.workloads import ARRIVALS, LENGTHS, WorkloadConfig, make_workload
from minisarathi.cli_args import (
    API_KEY_ENV,
    HelpFormatter,
    add_engine_arguments,
    check_engine_arguments,
    engine_flags,
    engine_options_from_args,
    read_api_key,
    refuse_unneeded,
)
from minisarathi.client import DEFAULT_PORT
from minisarathi.config import SCHEDULERS

PROMPT_VOCAB = 512  # synthetic prompt ids stay below this: valid for every Llama-family vocabulary
OPENAI_MAX_MODEL_LEN = (
    2048  # for an OpenAI endpoint whose /v1/models has no max_model_len (--max-model-len overrides)
)
MIN_TRIAL_REQUESTS = 4
MAX_ERRORS_SHOWN = 5  # distinct errors of a run's failed requests printed


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(
        dest="bench_command", required=True, metavar="{run,capacity,compare,plot,random-model}"
    )

    def command(name: str, help_text: str, description: str = "") -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help_text,
            description=f"{help_text}. {description}".strip(),
            formatter_class=HelpFormatter,
        )

    in_process = "MODEL (default: the bundled stories260K) runs in this process"
    run = command(
        "run",
        "replay one workload against one target and report its metrics",
        f"With --target engine (the default), {in_process}.",
    )
    capacity = command(
        "capacity",
        "highest Poisson QPS within the TBT and scheduling-delay SLOs",
        f"With --target engine (the default), {in_process}.",
    )
    compare = command("compare", "the same workload under several policies, side by side", f"{in_process}.")
    for p in (run, capacity):
        _add_target_arguments(p)
    for p in (run, capacity, compare):
        _add_workload_arguments(p)
        add_engine_arguments(p)
        p.add_argument(
            "--out", type=Path, default=None, help="results folder (default: bench/out/<date>-<command>)"
        )
        p.add_argument(
            "--time-limit",
            type=float,
            default=None,
            help="seconds a run (a capacity trial) may take; what is unfinished then is aborted "
            "(default: run 600; trial 2x the arrival span + 30)",
        )
        p.set_defaults(check=functools.partial(_check_arguments, p))
    for p in (capacity, compare):
        _add_slo_arguments(p)
    compare.add_argument(
        "--policies",
        default="sarathi,vllm,orca,simple_chunking",
        help="comma-separated schedulers (default: %(default)s)",
    )
    compare.add_argument(
        "--chunk-sizes",
        default=None,
        help="comma-separated chunk sizes for sarathi and simple_chunking (default: --chunk-size)",
    )
    compare.add_argument("--capacity", action="store_true", help="also search each policy's capacity")
    compare.add_argument(
        "--slo-driven",
        action="store_true",
        help="add sarathi-slo: sarathi with --tbt-slo-ms set to the capacity SLO",
    )
    run.add_argument("--label", default=None, help="the run's name in the results (default: the scheduler)")
    plot = command("plot", "redraw the plots of a `bench compare` results folder")
    plot.add_argument("results", type=Path, help="the folder holding compare.json")
    for p in (compare, plot):
        p.add_argument(
            "--plots", type=Path, default=None, help="write the PNG plots here too (e.g. docs/plots)"
        )
    random_model = command("random-model", "write a seeded random-weight Llama folder of a chosen shape")
    random_model.add_argument("path", type=Path, help="the folder to write")
    for flag, default in (
        ("--hidden-size", 512),
        ("--num-layers", 4),
        ("--num-heads", 8),
        ("--num-kv-heads", 4),
        ("--intermediate-size", 1408),
        ("--max-position-embeddings", 2048),
    ):
        random_model.add_argument(flag, type=int, default=default, help="the model's config.json field")
    random_model.add_argument("--seed", type=int, default=0, help="seed of the weights")
    random_model.add_argument(
        "--vocab-size", type=int, default=512, help="the model's (the tokenizer keeps 512)"
    )


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses the flags of run, capacity and compare that would not take effect."""
    target = getattr(args, "target", "engine")  # compare runs engines only
    if target == "engine":
        check_engine_arguments(parser, args)
    remote = "needs --target engine (a remote target runs its own model)"
    rules = [(flag, target == "engine", remote) for flag in engine_flags(args) if flag != "--max-model-len"]
    if hasattr(args, "target"):
        rules += [
            ("--host", target == "server", "needs --target server"),
            ("--port", target == "server", "needs --target server"),
            ("--url", target == "openai", "needs --target openai"),
            ("--openai-model", target == "openai", "needs --target openai"),
            ("--api-key-file", target != "engine", "needs --target server or openai"),
        ]
    lengths, arrivals = args.lengths, args.arrivals
    rules += [
        ("--prompt-len", lengths == "fixed", "needs --lengths fixed"),
        ("--decode-len", lengths == "fixed", "needs --lengths fixed"),
        *(
            (flag, lengths in ("uniform", "zipf"), "needs --lengths uniform or zipf")
            for flag in ("--min-total-tokens", "--max-total-tokens", "--pd-ratio")
        ),
        ("--zipf-theta", lengths == "zipf", "needs --lengths zipf"),
        ("--trace", lengths == "trace", "needs --lengths trace"),
        ("--trace-scale", lengths == "trace", "needs --lengths trace"),
        ("--cv", arrivals == "gamma", "needs --arrivals gamma"),
        ("--arrival-trace", arrivals == "trace", "needs --arrivals trace"),
        ("--long-factor", args.long_fraction > 0, "needs --long-fraction above 0"),
    ]
    if hasattr(args, "slo_tbt"):
        rules.append(
            ("--slo-scale", args.slo_tbt is None, "scales the measured decode step: not with --slo-tbt")
        )
    refuse_unneeded(parser, args, rules)


def _add_target_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument(
        "--target",
        choices=("engine", "server", "openai"),
        default="engine",
        help="engine: in this process; server: a minisarathi server; openai: /v1/completions (SSE)",
    )
    g.add_argument("--host", default="127.0.0.1", help="server target's address (default: %(default)s)")
    g.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="server target's port (default: %(default)s)"
    )
    g.add_argument(
        "--url", default="http://127.0.0.1:8000", help="openai target's base URL (default: %(default)s)"
    )
    g.add_argument("--openai-model", default=None, help="the `model` field sent to the openai target")
    g.add_argument(
        "--api-key-file",
        default=None,
        help=f"file holding the remote target's API key (or set ${API_KEY_ENV})",
    )


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    g.add_argument(
        "--lengths",
        choices=LENGTHS,
        default="trace",
        help="request lengths: fixed, uniform, zipf, or trace rows (default: the bundled ShareGPT trace)",
    )
    g.add_argument("--prompt-len", type=int, default=128, help="fixed: prompt tokens")
    g.add_argument("--decode-len", type=int, default=32, help="fixed: output tokens")
    g.add_argument(
        "--min-total-tokens", type=int, default=64, help="uniform, zipf: least prompt + output tokens"
    )
    g.add_argument(
        "--max-total-tokens", type=int, default=512, help="uniform, zipf: most prompt + output tokens"
    )
    g.add_argument("--pd-ratio", type=float, default=4.0, help="uniform, zipf: prefill:decode token ratio")
    g.add_argument("--zipf-theta", type=float, default=0.6, help="zipf: skew of the total lengths")
    g.add_argument(
        "--trace", default=None, help="CSV with num_prefill_tokens,num_decode_tokens (default: ShareGPT)"
    )
    g.add_argument(
        "--trace-scale", type=float, default=1.0, help="multiply trace lengths (before the max-length cut)"
    )
    g.add_argument("--arrivals", choices=ARRIVALS, default="poisson", help="arrival process")
    g.add_argument(
        "--qps", type=float, default=1.0, help="requests per second (capacity: the first QPS tried)"
    )
    g.add_argument("--cv", type=float, default=2.0, help="gamma arrivals: coefficient of variation")
    g.add_argument("--arrival-trace", default=None, help="trace arrivals: CSV with an arrived_at column (s)")
    g.add_argument("--workload-seed", type=int, default=0, help="seed of lengths, arrivals and prompts")
    g.add_argument(
        "--long-fraction",
        type=float,
        default=0.0,
        help="share of requests with prompts --long-factor x the median (metrics also per short/long)",
    )
    g.add_argument("--long-factor", type=float, default=16.0, help="long prompts: this many x the median")
    g.add_argument(
        "--high-priority-fraction",
        type=float,
        default=0.0,
        help="share of requests sent with priority 0, the others with 1 (metrics also per high/low)",
    )


def _add_slo_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("capacity")
    g.add_argument(
        "--slo-tbt",
        type=float,
        default=None,
        help="P99 TBT SLO in seconds (default: --slo-scale x the measured batch-32 decode step)",
    )
    g.add_argument(
        "--slo-scale", type=float, default=5.0, help="(default %(default)s: Sarathi-Serve's strict SLO)"
    )
    g.add_argument(
        "--max-sched-delay", type=float, default=2.0, help="bound on the median scheduling delay (s)"
    )
    g.add_argument("--granularity", type=float, default=0.1, help="relative precision of the capacity")
    g.add_argument("--max-trials", type=int, default=10, help="trials of the capacity search at most")
    g.add_argument(
        "--trial-seconds",
        type=float,
        default=None,
        help=f"fewer requests per trial where --num-requests would arrive over more than this "
        f"many seconds (at least {MIN_TRIAL_REQUESTS})",
    )


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "random-model":
        return _run_random_model(args)
    if args.bench_command == "plot":
        return _run_plot(args)
    if args.time_limit is not None and not args.time_limit > 0:
        raise ValueError(f"time_limit must be a positive number of seconds, got {args.time_limit}")
    out_dir = args.out or Path("bench/out") / f"{time.strftime('%Y%m%d-%H%M%S')}-{args.bench_command}"
    _check_out_dir(out_dir)  # before a run of minutes, not when its results are saved
    session = _Session(args, out_dir)
    try:
        status = {"run": session.run, "capacity": session.capacity, "compare": session.compare}[
            args.bench_command
        ]()
    except KeyboardInterrupt:
        print(f"\ninterrupted: partial results saved in {out_dir}", file=sys.stderr)
        return 130
    print(f"results in {out_dir}")
    return status or 0


def _check_out_dir(path: Path) -> None:
    """ValueError naming --out unless `path` is a folder or one can be made there."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--out {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: cannot write in {existing}")


class _Session:
    """One bench command: its targets, workload and output folder."""

    def __init__(self, args: argparse.Namespace, out_dir: Path):
        self.args, self.out_dir = args, out_dir
        self.info = {
            "command": args.bench_command,
            "argv": sys.argv[1:],
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs".strip(),
            "python": platform.python_version(),
        }

    # Targets

    def engine(self, **overrides):
        from minisarathi.engine.engine import LLMEngine

        engine = LLMEngine(**(engine_options_from_args(self.args) | overrides))
        target = EngineTarget(engine)
        target.warmup()
        return target, engine.max_model_len

    def target(self):
        args = self.args
        if args.target == "engine":
            return self.engine()
        api_key = read_api_key(args.api_key_file)
        if args.target == "openai":
            target = OpenAITarget(args.url, args.openai_model, api_key)
            return target, args.max_model_len or _openai_max_model_len(target)
        target = ServerTarget(args.host, args.port, api_key)
        return target, args.max_model_len or _server_max_model_len(args.host, args.port, api_key)

    def workload(
        self, max_model_len: int, qps: float | None = None, num_requests: int | None = None
    ) -> tuple[WorkloadConfig, list]:
        a = self.args
        cfg = WorkloadConfig(
            num_requests=num_requests or a.num_requests,
            lengths=a.lengths,
            prompt_len=a.prompt_len,
            decode_len=a.decode_len,
            min_total_tokens=a.min_total_tokens,
            max_total_tokens=a.max_total_tokens,
            pd_ratio=a.pd_ratio,
            zipf_theta=a.zipf_theta,
            trace=a.trace,
            trace_scale=a.trace_scale,
            max_model_len=max_model_len,
            arrivals=a.arrivals,
            qps=qps or a.qps,
            cv=a.cv,
            arrival_trace=a.arrival_trace,
            vocab_size=PROMPT_VOCAB,
            seed=a.workload_seed,
            long_fraction=a.long_fraction,
            long_factor=a.long_factor,
            high_priority_fraction=a.high_priority_fraction,
        )
        return cfg, make_workload(cfg)

    def run_info(self, target, workload: WorkloadConfig | None = None) -> dict:
        """What one run (or one capacity search) measured: the session's info, its engine and its workload."""
        info = dict(self.info)
        if isinstance(target, EngineTarget):
            info["engine"] = dataclasses.asdict(target.engine.config)
        if workload is not None:
            info["workload"] = dataclasses.asdict(workload)
        return info

    # One timed run, saved; partial results are saved too when Ctrl-C stops it.

    def timed_run(
        self, target, workload: tuple[WorkloadConfig, list], label: str, time_limit: float, **run_options
    ) -> tuple:
        cfg, specs = workload
        info = self.run_info(target, cfg)
        try:
            result = target.run(specs, time_limit, label, **run_options)
        except KeyboardInterrupt:
            if target.partial:
                self.save(label + "_partial", target.partial, info)
            raise
        if result.stopped:
            print(f"[{label}] stopped early, {result.stopped}: unfinished requests aborted", file=sys.stderr)
        return result, self.save(label, result, info)

    def save(self, label: str, result, info: dict) -> dict:
        metrics = compute_metrics(result.requests, result.batches) | {
            "stopped": result.stopped,
            "groups": metrics_by_group(result.requests),
        }
        save_run(self.out_dir, label, info, metrics, result.requests, result.batches)
        return metrics

    def trial_limit(self, workload) -> float:
        return self.args.time_limit or 2 * max(s.arrival_time for s in workload[1]) + 30

    # Commands

    def run(self) -> int:
        """Exit status 1 when a request did not complete (its error summarized), else 0."""
        target, max_model_len = self.target()
        label = self.args.label or (self.args.scheduler if self.args.target == "engine" else self.args.target)
        result, metrics = self.timed_run(
            target, self.workload(max_model_len), label, self.args.time_limit or 600.0
        )
        print(format_table({label: metrics} | {f"{label}:{g}": m for g, m in metrics["groups"].items()}))
        failed = [r for r in result.requests if not r.completed]
        if not failed:
            return 0
        print(
            f"[{label}] {len(failed)} of {len(result.requests)} requests did not complete:", file=sys.stderr
        )
        for error, count in collections.Counter(r.error or "unfinished" for r in failed).most_common(
            MAX_ERRORS_SHOWN
        ):
            print(f"  {count} x {error}", file=sys.stderr)
        return 1

    def slo(self, target, max_model_len: int) -> Slo:
        args = self.args
        if args.slo_tbt is None:
            if not isinstance(target, EngineTarget):
                raise ValueError("slo_tbt must be given (seconds) for a remote target")
            # Decodes over contexts as long as the workload's typical prompt.
            context = int(np.median([len(s.prompt_token_ids) for s in self.workload(max_model_len)[1]]))
            context = min(
                context, target.engine.max_model_len - DECODE_PROBE_STEPS - 2
            )  # the probe's longest
            step, _ = measure_decode_step(target.engine, batch_size=32, prompt_len=context)
            args.slo_tbt = args.slo_scale * step
            self.info["decode_step_s"] = step
            print(
                f"decode step at batch 32, context {context}: {step * 1e3:.1f} ms -> P99 TBT SLO "
                f"{args.slo_tbt * 1e3:.1f} ms ({args.slo_scale:g}x)"
            )
        slo = Slo(args.slo_tbt, args.max_sched_delay)
        self.info["slo"] = dataclasses.asdict(slo)
        return slo

    def search(self, target, max_model_len: int, slo: Slo, label: str) -> tuple[float, list]:
        # In process, a trial stops as soon as it is sure to miss the SLO: overload costs seconds, not
        # minutes.
        options = {"slo": slo} if isinstance(target, EngineTarget) else {}

        def trial(qps: float):
            num_requests = self.args.num_requests
            if self.args.trial_seconds:  # the first requests of the same workload: same lengths and prompts
                num_requests = min(
                    num_requests, max(MIN_TRIAL_REQUESTS, math.ceil(qps * self.args.trial_seconds))
                )
            workload = self.workload(max_model_len, qps, num_requests)
            _, metrics = self.timed_run(
                target, workload, f"{label}_qps{qps:.3f}", self.trial_limit(workload), **options
            )
            return judge(qps, metrics, slo)

        print(
            f"[{label}] capacity search: P99 TBT <= {slo.p99_tbt * 1e3:.1f} ms, median scheduling delay <= "
            f"{slo.median_scheduling_delay:g} s, up to {self.args.num_requests} requests per trial"
        )
        capacity, trail = find_capacity(
            trial,
            self.args.qps,
            self.args.granularity,
            self.args.max_trials,
            on_trial=lambda t: print(f"[{label}] {t.describe()}", flush=True),
        )
        print(f"[{label}] capacity {capacity:.3f} qps")
        return capacity, trail

    def capacity(self):
        target, max_model_len = self.target()
        label = self.args.scheduler if self.args.target == "engine" else self.args.target
        capacity, trail = self.search(target, max_model_len, self.slo(target, max_model_len), label)
        self.write_json(
            "capacity.json",
            {
                "info": self.run_info(target),
                "capacity_qps": capacity,
                "trail": [dataclasses.asdict(t) for t in trail],
            },
        )

    def compare(self):
        args = self.args
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        for p in policies:
            if p not in SCHEDULERS:
                raise ValueError(f"policies: unknown scheduler {p!r} (choose from {', '.join(SCHEDULERS)})")
        chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")] if args.chunk_sizes else [args.chunk_size]
        variants = policy_variants(policies, chunk_sizes, args.slo_driven)
        slo = workload = None
        metrics, runs, capacities, trails, engines = {}, {}, {}, {}, {}
        try:
            for v in variants:
                if (
                    slo is None and v.slo_driven
                ):  # its target is the SLO: measure that on a plain engine first
                    slo = self.slo(*self.engine(scheduler="sarathi", tbt_slo_ms=None))
                target, max_model_len = self.engine(
                    scheduler=v.scheduler,
                    chunk_size=v.chunk_size,
                    tbt_slo_ms=slo.p99_tbt * 1e3 if v.slo_driven else None,
                )
                engines[v.label] = dataclasses.asdict(target.engine.config)
                if slo is None:
                    slo = self.slo(target, max_model_len)
                workload = self.workload(max_model_len)
                result, metrics[v.label] = self.timed_run(target, workload, v.label, args.time_limit or 600.0)
                runs[v.label] = (result.requests, result.batches)
                print(
                    f"[{v.label}] P99 TBT {_ms(metrics[v.label]['tbt']['p99'])}, "
                    f"P50 TTFT {_ms(metrics[v.label]['ttft']['p50'])}",
                    flush=True,
                )
                if args.capacity:
                    capacities[v.label], trails[v.label] = self.search(target, max_model_len, slo, v.label)
                del target  # frees this engine's KV cache before the next one allocates its own
        finally:
            info = self.info | {
                "workload": dataclasses.asdict(workload[0]) if workload else None,
                "engines": engines,
            }
            self.report(metrics, runs, capacities, trails, info)

    def report(self, metrics, runs, capacities, trails, info: dict):
        if not metrics:
            return
        print(
            f"\nqps {self.args.qps:g}, {self.args.num_requests} requests, workload seed "
            f"{self.args.workload_seed}"
        )
        print(format_table(metrics))
        baseline = "vllm" if "vllm" in metrics else None
        ratios = {label: tbt_ratio(metrics, label, baseline) for label in metrics} if baseline else {}
        for label, ratio in ratios.items():
            if label != baseline and ratio is not None:
                print(f"P99 TBT {label} / {baseline}: {ratio:.2f}")
        if capacities:
            print()
            print(capacity_table(capacities, baseline if baseline in capacities else None))
        self.write_json(
            "compare.json",
            {
                "info": info,
                "qps": self.args.qps,
                "metrics": metrics,
                "p99_tbt_ratio_to_vllm": ratios,
                "capacity_qps": capacities,
                "trails": {k: [dataclasses.asdict(t) for t in v] for k, v in trails.items()},
            },
        )
        _plot(runs, capacities, self.out_dir, self.args.qps, self.args.plots)

    def write_json(self, name: str, data: dict) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / name).write_text(json.dumps(data, indent=1))


def _server_max_model_len(host: str, port: int, api_key: str | None) -> int:
    """The longest request (prompt + output tokens) a minisarathi server accepts, from its model_info."""
    from minisarathi.client import Client, RPCError

    try:
        with Client(host, port, api_key=api_key, timeout=30) as client:
            info = client.model_info()
    except (OSError, RPCError) as e:
        raise ValueError(
            f"--host {host} --port {port}: no answer to model_info ({getattr(e, 'strerror', None) or e})"
        ) from None
    return min(info["max_model_len"], info["max_prompt_tokens"], info["max_tokens"])


def _openai_max_model_len(target: OpenAITarget) -> int:
    """The endpoint's context length from GET /v1/models (vLLM and minisarathi give it), else the default."""
    card = target.model_card()
    if isinstance(card.get("max_model_len"), int) and card["max_model_len"] > 1:
        return card["max_model_len"]
    print(
        f"{target.url}/v1/models gives no max_model_len: requests are cut to {OPENAI_MAX_MODEL_LEN} tokens "
        "(--max-model-len sets another length)",
        file=sys.stderr,
    )
    return OPENAI_MAX_MODEL_LEN


def _plot(runs, capacities, out_dir: Path, qps: float, copy_to: Path | None) -> None:
    from minisarathi.bench.plots import plot_comparison

    for path in plot_comparison(runs, capacities, out_dir, f"({qps:g} qps)"):
        print(f"plot: {path}")
        if copy_to:
            copy_to.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, copy_to / path.name)


def _run_plot(args) -> int:
    summary = args.results / "compare.json"
    if not summary.is_file():
        raise ValueError(f"results must be a `bench compare` folder with compare.json, got {args.results}")
    data = json.loads(summary.read_text())
    runs = {}
    for label in data["metrics"]:
        _, requests, batches = load_run(args.results / f"{label}.json")
        runs[label] = (requests, batches)
    _plot(runs, data["capacity_qps"], args.results, data["qps"], args.plots)
    return 0


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _run_random_model(args) -> int:
    from minisarathi.bench.random_model import write_random_model

    try:
        path = write_random_model(
            args.path,
            args.hidden_size,
            args.num_layers,
            args.num_heads,
            args.num_kv_heads,
            args.intermediate_size,
            args.max_position_embeddings,
            args.seed,
            args.vocab_size,
        )
    except OSError as e:
        raise ValueError(f"path {args.path}: cannot be written ({e.strerror or e})") from None
    print(f"wrote {path} ({(path / 'model.safetensors').stat().st_size / 2**20:.1f} MiB of float32 weights)")
    return 0
