"""The CPU backend's decode attention alone, per step over a model's layers: NumPy's path (with its kept
decode K/V) against the native kernel, in turns, on the same caches.

    python -m bench.cpu_decode_attention          # TinyLlama's shape: 22 layers, 32/4 heads, D 64
    python -m bench.cpu_decode_attention --batches 1,16 --contexts 128,512,1024 --head-dim 128 --kv-heads 8

Each step writes one new key per decode (CpuOps.store_kv, as the model does) and advances every context by
one, then calls CpuOps.paged_attention for every layer; the time of a step is those calls (the attention plan
included, as in the engine). Prints one JSON line per case: ms per step, best of --repeats runs of --steps
steps, for each path, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from minisarathi.backends.cpu import native_attention
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.cpu.process_setup import configure_cpu
from minisarathi.testing import ScheduledChunk, build_batch

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def run_steps(ops, caches, tables, contexts, q, block_size, steps, clock) -> float:
    """Seconds for `steps` decode steps from `contexts` (each decode's keys before the step)."""
    S, Hk, D = len(tables), caches[0][0].shape[1], caches[0][0].shape[3]
    kv = np.ones((S, Hk, D), np.float32)
    total = 0.0
    for step in range(steps):
        chunks = [ScheduledChunk([0], c + step, t, True) for c, t in zip(contexts, tables)]
        batch = build_batch(chunks, block_size)
        slots = np.array(
            [
                t[(c + step) // block_size] * block_size + (c + step) % block_size
                for c, t in zip(contexts, tables)
            ]
        )
        start = clock()
        for k_cache, v_cache in caches:
            ops.store_kv(kv, kv, k_cache, v_cache, slots)
            ops.paged_attention(q, k_cache, v_cache, batch, D**-0.5)
        total += clock() - start
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default="128,512,1024")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="the engine's thread count (default: auto)")
    p.add_argument("--clock", choices=CLOCKS, default="wall")
    args = p.parse_args()
    configure_cpu(args.threads)
    clock = CLOCKS[args.clock]
    kernel = native_attention.kernel()
    if kernel is None:
        raise SystemExit("the native decode attention does not run here")
    rng = np.random.default_rng(0)
    bs, Hq, Hk, D = args.block_size, args.heads, args.kv_heads, args.head_dim
    for S in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            per_seq = -(-(context + args.steps * args.repeats + 1) // bs)
            num_blocks = S * per_seq + 8
            order = rng.permutation(num_blocks)
            tables = [order[s * per_seq : (s + 1) * per_seq].tolist() for s in range(S)]
            contexts = [context] * S
            q = rng.standard_normal((S, Hq, D)).astype(np.float32)
            times = {}
            for path in ("numpy", "native"):
                runs = native_attention.runs
                native_attention.runs = (lambda: True) if path == "native" else (lambda: False)
                try:
                    ops = CpuOps()
                    caches = [
                        (ops.zeros((num_blocks, Hk, bs, D)), ops.zeros((num_blocks, Hk, bs, D)))
                        for _ in range(args.layers)
                    ]
                    for k_cache, v_cache in caches:
                        k_cache[...] = rng.standard_normal(k_cache.shape, np.float32)
                        v_cache[...] = rng.standard_normal(v_cache.shape, np.float32)
                    run_steps(ops, caches, tables, contexts, q, bs, 1, clock)  # warm-up: keeps NumPy's copy
                    best = min(
                        run_steps(
                            ops,
                            caches,
                            tables,
                            [c + 1 + r * args.steps for c in contexts],
                            q,
                            bs,
                            args.steps,
                            clock,
                        )
                        for r in range(args.repeats)
                    )
                    times[path] = 1e3 * best / args.steps
                finally:
                    native_attention.runs = runs
                del caches, ops
            row = {
                "batch": S,
                "context": context,
                "layers": args.layers,
                "Hq": Hq,
                "Hk": Hk,
                "D": D,
                "block_size": bs,
                "numpy_ms": round(times["numpy"], 3),
                "native_ms": round(times["native"], 3),
                "numpy/native": round(times["numpy"] / times["native"], 2),
                "isa": kernel.isa,
                "machine": platform.machine(),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
