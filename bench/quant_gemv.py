"""The quantized matmuls of one forward alone, on a model's matrix shapes, per weight type, in turns:
Q8_0 with its fp16 scales as the file keeps them, the same int8 values with float32 scales (the CPU form
before fp16 scales were kept), and the K-quants Q4_K and Q6_K (the types of a Q4_K_M file).

    python -m bench.quant_gemv                        # TinyLlama's shapes, 22 layers, rows 1 and 16
    python -m bench.quant_gemv --rows 1 --threads 1 --types Q4_K,Q6_K

Random weights (random int8 values and scales for Q8_0; the K-quants through minisarathi.quant.kquants): the
kernel's time does not depend on the values. Each layer's matrices are copies of their own, so a forward
reads as many bytes from memory as a model of that shape. Prints one JSON line per (rows, threads): per type,
ms for all the matrices (best of --repeats), the tokens per second one decode stream's matmuls would allow
(rows / ms), and GB/s over the compact weights' bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from minisarathi.backends.cpu import quant_linear
from minisarathi.quant import kquants
from minisarathi.quant.layouts import GgmlType, IntGroups, from_gguf

TYPES = ("Q8_0", "Q8_0-float32", "Q4_K", "Q6_K")


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


def layout(name: str, n: int, k: int, rng: np.random.Generator):
    """A random [n, k] layout of type `name` (TYPES); both Q8_0 forms hold the same int8 values."""
    if name.startswith("Q8_0"):
        values = np.random.default_rng(n * k).integers(-127, 128, (n, k), dtype=np.int8)
        scale = (np.random.default_rng(n + k).random((n, k // 32), dtype=np.float32) * 1e-3).astype(
            np.float16
        )
        return IntGroups(values, scale if name == "Q8_0" else scale.astype(np.float32), 32, 8, (n, k), "Q8_0")
    weights = rng.standard_normal((n, k), dtype=np.float32)
    return from_gguf("w", GgmlType[name], kquants.quantize(weights, name))


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
    p.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, of {', '.join(TYPES)}")
    args = p.parse_args()
    native = quant_linear.kernel()
    if native is None:
        raise SystemExit("the quantized matmul does not run here")
    types = args.types.split(",")
    unknown = sorted(set(types) - set(TYPES))
    if unknown:
        raise SystemExit(f"--types: unknown {', '.join(unknown)}; choose among {', '.join(TYPES)}")
    rng = np.random.default_rng(0)
    bases = {}  # (type, N, K): one layout per shape, copied for every layer
    forms = {name: [] for name in types}
    for n, k in shapes(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab):
        for name in types:
            if (name, n, k) not in bases:
                bases[name, n, k] = layout(name, n, k, rng)
            base = bases[name, n, k]
            arrays = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
            copied = {key: v.copy() for key, v in arrays.items() if isinstance(v, np.ndarray)}
            forms[name].append(quant_linear.quant_weight(dataclasses.replace(base, **copied)))
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
