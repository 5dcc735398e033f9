"""The quantized matmuls of one forward alone, on a model's matrix shapes: Q8_0 with its fp16 scales as the
file keeps them against the same weights with float32 scales (the CPU form before fp16 scales were kept),
in turns, on the same int8 values.

    python -m bench.quant_gemv                        # TinyLlama's shapes, 22 layers, rows 1 and 16
    python -m bench.quant_gemv --rows 1 --threads 1

Random int8 values and scales (no quantizer: the kernel's time does not depend on the values). Prints one
JSON line per (rows, threads): ms for all the matrices (best of --repeats), and the tokens per second one
decode stream's matmuls would allow (rows / ms).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from minisarathi.backends.cpu import quant_linear
from minisarathi.quant.layouts import IntGroups


def shapes(hidden, layers, heads, kv_heads, intermediate, vocab):
    """[(N, K)]: q/k/v fused, o, gate/up fused and down per layer, then lm_head."""
    head_dim = hidden // heads
    layer = [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, hidden),
        (2 * intermediate, hidden),
        (hidden, intermediate),
    ]
    return layer * layers + [(vocab, hidden)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rows", default="1,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    native = quant_linear.kernel()
    if native is None:
        raise SystemExit("the quantized matmul does not run here")
    rng = np.random.default_rng(0)
    forms = {"fp16 scales": [], "float32 scales": []}
    for n, k in shapes(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab):
        values = rng.integers(-127, 128, (n, k), dtype=np.int8)
        scale = (rng.random((n, k // 32), dtype=np.float32) * 1e-3).astype(np.float16)  # float16[N, K // 32]
        for name, s in (("fp16 scales", scale), ("float32 scales", scale.astype(np.float32))):
            forms[name].append(quant_linear.quant_weight(IntGroups(values, s, 32, 8, (n, k), "Q8_0")))
    for rows in map(int, args.rows.split(",")):
        x = {k: rng.standard_normal((rows, k), dtype=np.float32) for k in {args.hidden, args.intermediate}}
        for threads in map(int, args.threads.split(",")):
            best = dict.fromkeys(forms, float("inf"))
            for _ in range(args.repeats):
                for name, weights in forms.items():  # in turns: other load falls on both alike
                    start = time.perf_counter()
                    for w in weights:
                        native.matmul(x[w.shape[1]], w, threads=threads)
                    best[name] = min(best[name], time.perf_counter() - start)
            row = {"rows": rows, "threads": threads, "isa": native.best_isa}
            for name, seconds in best.items():
                nbytes = sum(w.nbytes for w in forms[name])
                row[name] = {
                    "ms": round(1e3 * seconds, 1),
                    "tok/s": round(rows / seconds, 2),
                    "GB/s": round(nbytes / seconds / 1e9, 1),
                    "MB": round(nbytes / 1e6),
                }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
