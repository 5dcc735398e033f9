"""The forms a weight matmul can take in NumPy, timed side by side on the models' shapes (float32, one thread).

    python -m bench.matmul_layouts                          # every model and op, rows 1..512
    python -m bench.matmul_layouts --models tiny,small --rows 16,32,64

Weights are stored [N, K] as HF stores them; a linear layer of M token rows can be computed as
  x@w.T      x[M, K] @ w.T: the [M, N] result in C order (the backend's form before issue 15);
  w@x.T      (w @ x.T).T: BLAS computes the transposed product [N, M], returned as an [M, N] view (F order);
  w@x.T+copy the same, copied back to C order;
  w@xfm      w @ x_fm for an input already feature-major (x_fm[K, M] C order: the view the form above gives
             to the next layer, e.g. the MLP's down projection after silu_and_mul);
  numpy      CpuOps.linear on the weight as stored: NumPy's product as transposed_linear chooses it
             (minisarathi/backends/cpu/ops.py), so the rule can be checked against the table;
  packed     the packed matmul kernel on the weight packed once (minisarathi/backends/cpu/packed_gemm.py),
             what CpuOps.linear runs where the kernel builds and BLAS runs one thread (absent where it
             cannot).
With --cold each call reads its weight from memory, as a forward of a model larger than the caches does (the tiny
model's 28 MB and larger; the bundled model's 1 MB stays in cache). Each form is checked against the first; all
are timed in turns (best of --repeats, this thread's CPU time, one BLAS thread, the process set up as the engine
sets it up) so that load from other processes falls on all alike. Prints one JSON line per shape, rows and form
(GFLOP/s), then a table.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import numpy as np

from minisarathi.backends.cpu import packed_gemm
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.cpu.process_setup import configure_cpu

# model: (hidden H, heads Hq, KV heads Hk, head_dim D, intermediate I, vocab V)
MODELS = {"stories260K": (64, 8, 4, 8, 172, 512), "tiny": (256, 8, 4, 32, 2048, 512),
          "small": (512, 8, 4, 64, 2048, 512), "2048": (2048, 32, 8, 64, 5632, 32000)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
COLD_BYTES = 256 << 20


def op_shapes(H: int, Hq: int, Hk: int, D: int, I: int, V: int) -> dict[str, tuple[int, int]]:
    """op: (N, K) of its weight, as model/llama.py runs them."""
    return {"qkv": ((Hq + 2 * Hk) * D, H), "o": (H, Hq * D), "gate_up": (2 * I, H), "down": (H, I),
            "lm_head": (V, H)}


def forms(x: np.ndarray, weight, packed_weight, ops: CpuOps) -> dict:
    """name: a function computing x's product with weight() (packed_weight(): the same packed) in that form."""
    x_fm = np.ascontiguousarray(x.T)   # float32[K, M]
    named = {"x@w.T": lambda: x @ weight().T,
             "w@x.T": lambda: (weight() @ x.T).T,
             "w@x.T+copy": lambda: np.ascontiguousarray((weight() @ x.T).T),
             "w@xfm": lambda: weight() @ x_fm,
             "numpy": lambda: ops.linear(x, weight())}
    if packed_weight is not None:
        named["packed"] = lambda: ops.linear(x, packed_weight())
    return named


def best_seconds(fns: list, repeats: int, min_seconds: float) -> list[float]:
    """Per function, the best over repeats of the mean thread-CPU seconds of a call, in turns."""
    loops = []
    for fn in fns:
        fn()
        start, n = time.thread_time(), 0
        while time.thread_time() - start < min_seconds / 4 or n == 0:
            fn()
            n += 1
        per_call = (time.thread_time() - start) / n
        loops.append(max(1, int(min_seconds / max(per_call, 1e-7))))
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.thread_time()
            for _ in range(loops[i]):
                fn()
            best[i] = min(best[i], (time.thread_time() - start) / loops[i])
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ops", default="qkv,o,gate_up,down,lm_head")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-ms", type=float, default=10.0, help="CPU time per timed run of a form")
    parser.add_argument("--cold", action="store_true",
                        help="each call reads its weight from memory, not from a cache (copies used in turn)")
    args = parser.parse_args()
    setup = configure_cpu(1)   # as the engine sets the process up; one thread: its CPU time is the work
    print(setup.describe(), file=sys.stderr, flush=True)
    ops, rng = CpuOps(), np.random.default_rng(0)
    table = []
    for model in args.models.split(","):
        shapes = op_shapes(*MODELS[model])
        for op in args.ops.split(","):
            N, K = shapes[op]
            w = rng.standard_normal((N, K), dtype=np.float32)
            # --cold: copies in turn, together larger than any cache, as a forward reads a large model's weights
            copies = [w] + [w.copy() for _ in range(COLD_BYTES // w.nbytes if args.cold else 0)]
            weight = itertools.cycle(copies).__next__
            kernel = packed_gemm.kernel()
            packed_weight = None if kernel is None else itertools.cycle([kernel.pack(c) for c in copies]).__next__
            for M in map(int, args.rows.split(",")):
                x = rng.standard_normal((M, K), dtype=np.float32)
                named = forms(x, weight, packed_weight, ops)
                reference = named["x@w.T"]()
                for name, fn in named.items():
                    result = fn()
                    got = result.T if name == "w@xfm" else result
                    if not np.allclose(got, reference, rtol=1e-4, atol=1e-3 * np.sqrt(K)):
                        raise AssertionError(f"{model} {op} M={M}: {name} differs from x@w.T")
                seconds = best_seconds(list(named.values()), args.repeats, args.min_ms / 1e3)
                gflops = {name: round(2 * M * N * K / s / 1e9, 1) for name, s in zip(named, seconds)}
                row = {"bench": "matmul_layouts", "blas_kernels": setup.blas_kernels, "cold": args.cold,
                       "model": model, "op": op, "N": N, "K": K, "rows": M, "gflops": gflops}
                print(json.dumps(row), flush=True)
                table.append(row)
    names = list(table[0]["gflops"])
    where = "from memory" if args.cold else "in cache"
    print(f"\nGFLOP/s, one thread, weights {where}; OpenBLAS: {setup.blas_kernels}")
    print(f"{'model':12} {'op':8} {'N':>6} {'K':>5} {'rows':>5} " + " ".join(f"{n:>10}" for n in names))
    for r in table:
        print(f"{r['model']:12} {r['op']:8} {r['N']:6d} {r['K']:5d} {r['rows']:5d} "
              + " ".join(f"{r['gflops'][n]:10.1f}" for n in names))


if __name__ == "__main__":
    main()
