"""The whole edge-size matrix of the tensor-core prefill attention kernel on the CPU emulator vs NumPy.

    python -m bench.attention_matrix             # every case under forward, reverse and random orders
    python -m bench.attention_matrix --quick     # forward order only

tests/system/test_prefill_attention.py runs a subset in CI; this runs the cross product: both 16-bit types x
every head_dim x GQA 1/2/4/8 x block sizes 1/5/16 x the run sets below (context 1 via a 2-token chunk at the
start, block boundaries, chunk lengths around the 64-key tile, history 0 / shorter / longer than the chunk,
mixed with decodes), scattered block tables. Prints one JSON line per case (max error, tolerance, pass) and a
summary; exits 1 if any case fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import numpy as np

from minisarathi.backends import cuda_ops, emulator
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.dtypes import bf16_to_float32, float32_to_bf16
from minisarathi.testing import ScheduledChunk, build_batch

TOLERANCE = {"float16": 1e-3, "bfloat16": 8e-3}  # of the output's scale, as in the tests
GROUPS = [(8, 8), (8, 4), (8, 2), (8, 1)]  # (Hq, Hk): GQA 1, 2, 4, 8
BLOCK_SIZES = [1, 5, 16]
RUN_SETS = {
    "chunk2_at_start": [(0, 2)],
    "block_boundaries": [(16, 16), (15, 2), (31, 1), (32, 33)],
    "tile_edges": [(0, 63), (0, 64), (0, 65), (1, 127)],
    "history_gt_chunk": [(200, 3), (129, 70)],
    "mixed_with_decodes": [(0, 1), (40, 1), (7, 9), (0, 17), (63, 1)],
}


def case(seed, dtype, Hq, Hk, D, block_size, runs):
    rng = np.random.default_rng(seed)
    needs = [-(-(history + n) // block_size) for history, n in runs]
    pool = rng.permutation(sum(needs) + 3)  # scattered tables, spare blocks
    chunks, used = [], 0
    for (history, n), need in zip(runs, needs):
        chunks.append(
            ScheduledChunk(list(range(n)), history, [int(b) for b in pool[used : used + need]], True)
        )
        used += need
    batch = build_batch(chunks, block_size)

    def device(x):
        return float32_to_bf16(x) if dtype == "bfloat16" else x.astype(np.float16)

    shape = (len(pool), Hk, block_size, D)
    return (
        batch,
        device(rng.standard_normal((batch.num_tokens, Hq, D))),
        device(rng.standard_normal(shape)),
        device(rng.standard_normal(shape)),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="forward fiber order only")
    args = parser.parse_args()
    orders = ["forward"] if args.quick else ["forward", "reverse", "random"]
    failures = total = 0
    started = time.perf_counter()
    for dtype, D, (Hq, Hk), block_size, (name, runs) in itertools.product(
        TOLERANCE, cuda_ops.PREFILL_HEAD_DIMS, GROUPS, BLOCK_SIZES, RUN_SETS.items()
    ):
        batch, q, k_cache, v_cache = case(total, dtype, Hq, Hk, D, block_size, runs)
        widen = bf16_to_float32 if dtype == "bfloat16" else (lambda a: a.astype(np.float32))
        scale = 1 / np.sqrt(D)
        expected = CpuOps().paged_attention(widen(q), widen(k_cache), widen(v_cache), batch, scale)
        tolerance = TOLERANCE[dtype] * max(1.0, float(np.abs(expected).max()))
        ops = cuda_ops.emulated(dtype)
        for order in orders:
            with emulator.schedule(order, seed=total):
                error = float(
                    np.abs(widen(ops.paged_attention(q, k_cache, v_cache, batch, scale)) - expected).max()
                )
            ok = error <= tolerance
            failures += not ok
            total += 1
            print(
                json.dumps(
                    {
                        "dtype": dtype,
                        "head_dim": D,
                        "q_heads": Hq,
                        "kv_heads": Hk,
                        "block_size": block_size,
                        "runs": name,
                        "order": order,
                        "max_error": error,
                        "tolerance": tolerance,
                        "pass": ok,
                    }
                )
            )
    print(
        json.dumps({"cases": total, "failures": failures, "seconds": round(time.perf_counter() - started, 1)})
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
