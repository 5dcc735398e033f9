"""The HTTP door against the msgpack door on one server process (one engine), the same workload on each.

    nice python -m bench.http_vs_msgpack                          # 64 concurrent streams, bundled model
    nice python -m bench.http_vs_msgpack --rounds 3 --decode-len 128 --out bench/out/http_vs_msgpack.json

Starts `minisarathi serve --http-port 0`, then runs the workload (all requests at t=0: N concurrent
streams, greedy, EOS ignored, so every request yields exactly its decode length) through the msgpack door
(minisarathi's AsyncClient, one connection per request) and through the HTTP door (`/v1/completions` with
SSE, one connection per request), alternating doors for `--rounds` rounds so drift hits both alike.
Prints (and with --out writes as JSON) each door's output tokens/s and P99 TBT, summed and pooled over its
rounds, and the ratios HTTP / msgpack.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from minisarathi.bench.metrics import compute_metrics
from minisarathi.bench.targets import OpenAITarget, ServerTarget
from minisarathi.bench.workloads import WorkloadConfig, make_workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.http_vs_msgpack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the bundled stories260K)")
    parser.add_argument("--streams", type=int, default=64, help="concurrent requests (default 64)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="runs per door, alternating (default 2)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)

    workload = WorkloadConfig(num_requests=args.streams, lengths="fixed", prompt_len=args.prompt_len,
                              decode_len=args.decode_len, arrivals="static")
    specs = make_workload(workload)
    with _server(args.model, args.streams) as (msgpack_port, http_port):
        targets = {"msgpack": ServerTarget("127.0.0.1", msgpack_port),
                   "http": OpenAITarget(f"http://127.0.0.1:{http_port}")}
        targets["msgpack"].run(specs[:4], 60, "warmup")
        targets["http"].run(specs[:4], 60, "warmup")
        runs = {door: [] for door in targets}
        for _ in range(args.rounds):
            for door, target in targets.items():
                result = target.run(specs, 600, door)
                failed = [r for r in result.requests if not r.completed or r.output_len != r_len(specs, r)]
                if failed:
                    raise RuntimeError(f"{door}: {len(failed)} requests incomplete, e.g. {failed[0]}")
                runs[door].append(result.requests)
    summary = {door: _door_summary(rounds) for door, rounds in runs.items()}
    report = {"command": "python -m bench.http_vs_msgpack " + " ".join(argv if argv is not None else sys.argv[1:]),
              "streams": args.streams, "prompt_len": args.prompt_len, "decode_len": args.decode_len,
              "rounds": args.rounds, **summary,
              "ratio_output_tokens_per_s": summary["http"]["output_tokens_per_s"]
              / summary["msgpack"]["output_tokens_per_s"],
              "ratio_p99_tbt": summary["http"]["p99_tbt_s"] / summary["msgpack"]["p99_tbt_s"]}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def r_len(specs, record) -> int:
    return next(s.max_tokens for s in specs if s.request_id == record.request_id)


def _door_summary(rounds) -> dict:
    """Output tokens/s: all rounds' tokens over all rounds' durations; P99 TBT over every gap of every round."""
    metrics = [compute_metrics(requests) for requests in rounds]
    tokens = sum(r.output_len for requests in rounds for r in requests)
    pooled = compute_metrics([r for requests in rounds for r in requests])   # the gaps pooled; its duration unused
    return {"output_tokens_per_s": tokens / sum(m["duration_s"] for m in metrics),
            "p99_tbt_s": pooled["tbt"]["p99"], "p50_tbt_s": pooled["tbt"]["p50"],
            "per_round_output_tokens_per_s": [m["throughput"]["output_tokens_per_s"] for m in metrics]}


class _server:
    """`minisarathi serve` with both doors on free ports, as a separate process (the load generator here
    must not share its CPU time with the event loop it measures more than it has to)."""

    def __init__(self, model: str | None, streams: int):
        self.args = [*([model] if model else []), "--port", "0", "--http-port", "0", "--log-level", "WARNING",
                     "--max-num-seqs", str(max(streams, 1)), "--max-queued-requests", str(max(4 * streams, 1024))]

    def __enter__(self):
        self._tmp = tempfile.TemporaryDirectory()
        self._log = open(os.path.join(self._tmp.name, "server.log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "minisarathi", "serve", *self.args],
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)
        ports = {}
        deadline = time.monotonic() + 120
        while len(ports) < 2 and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            match = re.match(r"minisarathi serving on (http://)?[\d.]+:(\d+)", line)
            if match:
                ports["http" if match.group(1) else "msgpack"] = int(match.group(2))
        if len(ports) < 2:
            self.__exit__(None, None, None)
            raise RuntimeError("the server did not start")
        return ports["msgpack"], ports["http"]

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self._log.close()
        self._tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
