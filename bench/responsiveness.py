"""How promptly the server answers `health` while the engine thread runs long prefill steps.

    python -m bench.responsiveness                 # random 4-layer, hidden-512 Llama
    python -m bench.responsiveness --model models/stories260K --prompt-tokens 511

Starts `minisarathi serve` as a separate process, keeps its engine busy with back-to-back one-token
requests whose prompts fill one whole chunk (each is one prefill step), and meanwhile times `health`
round trips from another connection. Prints idle and busy latency percentiles and the prefill step time.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from minisarathi.client import Client


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.responsiveness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: a seeded random Llama)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--prefills", type=int, default=10, help="prefill requests sent back to back")
    parser.add_argument("--interval", type=float, default=0.002, help="seconds between health calls")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from minisarathi.bench.random_model import write_random_model
            model = str(write_random_model(os.path.join(tmp, "random-llama")))
        proc = subprocess.Popen([sys.executable, "-m", "minisarathi", "serve", model, "--port", "0",
                                 "--chunk-size", str(args.chunk_size), "--log-level", "WARNING"],
                                stdout=subprocess.PIPE, text=True)
        try:
            port = int(re.match(r"minisarathi serving on [\d.]+:(\d+)", proc.stdout.readline()).group(1))
            report = _measure(port, args)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    print(report)
    return 0


def _measure(port: int, args) -> str:
    rng = np.random.default_rng(0)
    with Client("127.0.0.1", port) as probe, Client("127.0.0.1", port) as loader:
        idle = _health_latencies(probe, 200, args.interval)
        step_times = []

        def load():
            for _ in range(args.prefills):
                ids = rng.integers(3, 512, args.prompt_tokens).tolist()
                step_times.append(loader.generate(ids, max_tokens=1, ignore_eos=True).extra["e2e_s"])

        loader.generate([1, 2, 3], max_tokens=1)   # warm up the model before timing
        worker = threading.Thread(target=load)
        worker.start()
        busy = []
        while worker.is_alive():
            busy += _health_latencies(probe, 1, args.interval)
        worker.join()
    ms = lambda values, q: f"{np.percentile(values, q) * 1e3:.2f} ms"  # noqa: E731
    return "\n".join([
        f"prefill step ({args.prompt_tokens} tokens, chunk {args.chunk_size}): median {ms(step_times, 50)}, "
        f"max {ms(step_times, 100)} over {len(step_times)} requests",
        f"health idle: p50 {ms(idle, 50)}, p99 {ms(idle, 99)}, max {ms(idle, 100)} ({len(idle)} calls)",
        f"health during prefills: p50 {ms(busy, 50)}, p99 {ms(busy, 99)}, max {ms(busy, 100)} ({len(busy)} calls)"])


def _health_latencies(client: Client, n: int, interval: float) -> list[float]:
    latencies = []
    for _ in range(n):
        start = time.perf_counter()
        client.health()
        latencies.append(time.perf_counter() - start)
        time.sleep(interval)
    return latencies


if __name__ == "__main__":
    sys.exit(main())
