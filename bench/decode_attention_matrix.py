"""The whole edge-size matrix of the decode attention kernel on the CPU emulator, against NumPy.

    python -m bench.decode_attention_matrix          # dtype x head_dim x GQA group x block size, 2 orders
    python -m bench.decode_attention_matrix --quick  # one order, bf16 only

tests/system/test_decode_attention.py runs a subset of this in CI (the emulator is slow); this runs all of it.
Each case is one decode batch whose contexts hit the edges: 1 key, a block boundary and one past it, split
lengths and one past them, an uneven last split, over scattered block tables. Prints one JSON line per case
(max error against NumPy's float32 attention, relative to the output's scale; the kernels launched) and
exits 1 if any case misses its dtype's tolerance.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import numpy as np

from minisarathi.backends import cuda_ops, decode_plan, emulator
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.dtypes import DTYPES, STORAGE_DTYPES, bf16_to_float32, float32_to_bf16
from minisarathi.testing import ScheduledChunk, build_batch

TOLERANCE = {"float32": 2e-5, "float16": 1e-3, "bfloat16": 8e-3}  # as tests/system/test_kernels.py
HEAD_DIMS = (64, 80, 96, 128, 256)
GROUPS = ((8, 8), (16, 4), (32, 4), (32, 8), (12, 2), (32, 2))  # (Hq, Hk): GQA 1, 4, 8, 4, 6, 16
BLOCK_SIZES = (1, 8, 16, 32)


def contexts(block_size: int) -> list[int]:
    split = decode_plan.MIN_SPLIT_KEYS
    return sorted({1, block_size, block_size + 1, 2 * block_size - 1, split, split + 1, 3 * split + 7, 200})


def run_case(
    dtype: str, head_dim: int, heads: tuple[int, int], block_size: int, order: str, seed: int
) -> dict:
    Hq, Hk = heads
    rng = np.random.default_rng(seed)
    lens = contexts(block_size)
    blocks = [-(-n // block_size) for n in lens]
    pool = rng.permutation(sum(blocks) + 3)  # scattered, with spare blocks nobody uses
    starts = np.cumsum([0] + blocks)
    chunks = [
        ScheduledChunk([0], n - 1, [int(b) for b in pool[starts[i] : starts[i + 1]]], True)
        for i, n in enumerate(lens)
    ]
    batch = build_batch(chunks, block_size)

    def device(x):
        return float32_to_bf16(x) if dtype == "bfloat16" else np.asarray(x, STORAGE_DTYPES[dtype])

    def host(x):
        return bf16_to_float32(x) if dtype == "bfloat16" else x.astype(np.float32)

    shape = (len(pool), Hk, block_size, head_dim)
    k_cache, v_cache = device(rng.standard_normal(shape)), device(rng.standard_normal(shape))
    q = device(rng.standard_normal((len(lens), Hq, head_dim)))
    ops = cuda_ops.emulated(dtype)
    launched = []
    kernel = ops.launcher.kernel
    ops.launcher.kernel = lambda file, name: launched.append(name) or kernel(file, name)
    start = time.perf_counter()
    with emulator.schedule(order, seed=seed):
        out = ops.paged_attention(q, k_cache, v_cache, batch, 1.0 / np.sqrt(head_dim))
    seconds = time.perf_counter() - start
    expected = CpuOps().paged_attention(host(q), host(k_cache), host(v_cache), batch, 1.0 / np.sqrt(head_dim))
    error = float(np.abs(host(out) - expected).max()) / max(1.0, float(np.abs(expected).max()))
    return {
        "dtype": dtype,
        "head_dim": head_dim,
        "q_heads": Hq,
        "kv_heads": Hk,
        "block_size": block_size,
        "order": order,
        "contexts": lens,
        "error": error,
        "ok": error <= TOLERANCE[dtype],
        "kernels": sorted(set(launched)),
        "seconds": round(seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="bf16 only, forward order only")
    args = parser.parse_args()
    dtypes = ("bfloat16",) if args.quick else DTYPES
    orders = ("forward",) if args.quick else ("forward", "reverse")
    failures = 0
    for seed, (dtype, head_dim, heads, block_size, order) in enumerate(
        itertools.product(dtypes, HEAD_DIMS, GROUPS, BLOCK_SIZES, orders)
    ):
        row = run_case(dtype, head_dim, heads, block_size, order, seed)
        failures += not row["ok"]
        print(json.dumps(row), flush=True)
    print(json.dumps({"cases": seed + 1, "failures": failures}))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
