"""The learning path's kernels (cuda/learn: naive paged attention up to tensor cores), each timed on a GPU.

    python -m bench.learn_kernels                          # a GPU (CuPy): the shapes below
    python -m bench.learn_kernels --device cuda-emulated   # a tiny shape on the CPU emulator: a dry run

The decode shape is 32 sequences x 4096 keys, 32 query heads over 8 KV heads, head_dim 128, bf16, block
size 16, blocks scattered over the cache. Every step runs on it; step 4 (tensor cores, made for many query
rows per KV head) also runs on prefill chunks of 128 new tokens per sequence over the same contexts; the
production op (CudaOps.paged_attention) runs on both. One JSON line per (kernel, shape): the median time of
a launch and the K/V bytes per second that implies, counting each KV head's keys and values once (the
least any kernel must read).

attend() launches one step; tests/system/test_learn_kernels.py holds each step to ReferenceOps through it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import numpy as np

from minisarathi.backends import cuda_ops, emulator
from minisarathi.batch import Batch
from minisarathi.dtypes import convert, dtype_name
from minisarathi.paths import cuda_dir
from minisarathi.testing import scattered_batch

LEARN_DIR = cuda_dir() / "learn"
STEPS = {
    "01_naive": "01_naive.cu",
    "02_online_softmax": "02_online_softmax.cu",
    "03_flash_decoding": "03_flash_decoding.cu",
    "04_tensor_core": "04_tensor_core.cu",
}
# Kernels templated on the element type only, per file; 04's are also templated on head_dim.
TYPED_KERNELS = {
    "01_naive.cu": ["naive_attention_kernel"],
    "02_online_softmax.cu": ["online_softmax_attention_kernel"],
    "03_flash_decoding.cu": ["flash_decoding_kernel", "merge_splits_kernel"],
}
TENSOR_CORE_TYPES = ("__half", "__nv_bfloat16")
TENSOR_CORE_HEAD_DIMS = (64, 128)
MAX_HEAD_DIM = 128  # steps 2 and 3: at most 4 accumulators per lane (OS_ / FD_MAX_HEAD_DIM)
TILE_KEYS = 32  # steps 2 and 3: keys per tile, one per lane
TENSOR_CORE_ROWS = 64  # step 4: (token, head) rows per CTA (TC_ROWS)

DECODE = {
    "seqs": 32,
    "context": 4096,
    "new_tokens": 1,
    "heads": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "block_size": 16,
}
EMULATED = {
    "seqs": 2,
    "context": 100,
    "new_tokens": 1,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 64,
    "block_size": 16,
}
PREFILL_TOKENS = {"cuda": 128, "cuda-emulated": 5}


def name_expressions(file: str) -> list[str]:
    """Every kernel of a cuda/learn file as NVRTC names it: `naive_attention_kernel<float>`, ..."""
    if file == STEPS["04_tensor_core"]:
        return [
            f"tensor_core_attention_kernel<{t}, {d}>"
            for t in TENSOR_CORE_TYPES
            for d in TENSOR_CORE_HEAD_DIMS
        ]
    return [f"{k}<{t}>" for k in TYPED_KERNELS[file] for t in cuda_ops.CXX_TYPES.values()]


class LearnKernels:
    """The kernels of cuda/learn on "cuda" (CuPy RawModules, NVRTC with the production kernels' options) or
    "cuda-emulated" (the same sources on the CPU emulator); xp is the array module, CuPy or NumPy."""

    def __init__(self, device: str):
        if device not in ("cuda", "cuda-emulated"):
            raise ValueError(f"device must be cuda or cuda-emulated, got {device!r}")
        self.device = device
        if device == "cuda":
            import cupy

            self.xp = cupy
        else:
            self.xp = np
        self._modules: dict[str, object] = {}

    def launch(self, file: str, name: str, grid, block, args, shared_mem: int = 0) -> None:
        module = self._modules.get(file)
        if module is None:
            if self.device == "cuda":
                module = self.xp.RawModule(
                    code=(LEARN_DIR / file).read_text(),
                    options=cuda_ops.nvrtc_options(f"learn/{file}"),
                    name_expressions=name_expressions(file),
                )
            else:
                module = emulator.load_module(LEARN_DIR / file, name_expressions(file), (cuda_dir(),))
            self._modules[file] = module
        kernel = module.get_function(name)
        # above 48 KiB a kernel must opt in
        kernel.max_dynamic_shared_size_bytes = max(kernel.max_dynamic_shared_size_bytes, shared_mem)
        kernel(grid, block, args, shared_mem=shared_mem)


def attend(
    kernels: LearnKernels,
    step: str,
    q,
    k_cache,
    v_cache,
    batch: Batch,
    scale: float,
    partition_keys: int = 512,
):
    """[T, Hq, D] attention of each query token of `batch` over its sequence's cached keys, by one step's
    kernels. q [T, Hq, D] and the caches [blocks, Hk, block_size, D] are device arrays of one dtype; steps 1-3
    take decodes only (one query token per sequence), step 4 any query runs in float16 or bfloat16."""
    xp, file = kernels.xp, STEPS[step]
    T, Hq, D = q.shape
    Hk, block_size = k_cache.shape[1], k_cache.shape[2]
    cxx = cuda_ops.CXX_TYPES[dtype_name(q)]
    tables = xp.asarray(batch.block_tables, dtype=np.int32)  # int32[S, B]
    lens = xp.asarray(batch.context_lens, dtype=np.int32)  # int32[S]
    S, B = tables.shape
    out = xp.empty_like(q)  # [T, Hq, D]
    i32 = np.int32
    if step == "04_tensor_core":
        if cxx not in TENSOR_CORE_TYPES or D not in TENSOR_CORE_HEAD_DIMS:
            raise ValueError(
                f"{step} takes float16 or bfloat16 and head_dim in {TENSOR_CORE_HEAD_DIMS}, got {cxx} and {D}"
            )
        starts = xp.asarray(batch.query_start, dtype=np.int32)  # int32[S + 1]
        grid = (-(-batch.max_query_len * (Hq // Hk) // TENSOR_CORE_ROWS), S, Hk)
        kernels.launch(
            file,
            f"tensor_core_attention_kernel<{cxx}, {D}>",
            grid,
            (128,),
            (
                q,
                k_cache,
                v_cache,
                starts,
                lens,
                tables,
                out,
                i32(Hq),
                i32(Hk),
                i32(block_size),
                i32(B),
                np.float32(scale),
            ),
        )
        return out
    if T != S:
        raise ValueError(f"{step} takes decodes only (one query token per sequence)")
    if step != "01_naive" and D > MAX_HEAD_DIM:
        raise ValueError(f"{step} takes head_dim up to {MAX_HEAD_DIM}, got {D}")
    common = (
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        out,
        i32(Hq),
        i32(Hk),
        i32(D),
        i32(block_size),
        i32(B),
        np.float32(scale),
    )
    if step == "01_naive":
        kernels.launch(
            file,
            f"naive_attention_kernel<{cxx}>",
            (S, Hq),
            (128,),
            common,
            shared_mem=4 * batch.max_context_len,
        )  # every score of the longest context
    elif step == "02_online_softmax":
        kernels.launch(
            file,
            f"online_softmax_attention_kernel<{cxx}>",
            (S, Hq),
            (32,),
            common,
            shared_mem=4 * (TILE_KEYS * (D + 1) + TILE_KEYS * D + D),
        )  # K, V tiles and q in float
    else:
        vec = 16 // q.dtype.itemsize
        if D % vec:
            raise ValueError(
                f"{step} copies key rows in 16-byte chunks: head_dim must be a multiple of {vec}"
            )
        splits = -(-batch.max_context_len // partition_keys)
        partial_out = xp.empty((S, Hq, splits, D) if splits > 1 else (1,), dtype=np.float32)
        partial_max = xp.empty((S, Hq, splits) if splits > 1 else (1,), dtype=np.float32)
        partial_sum = xp.empty_like(partial_max)
        stages = 2 * 2 * TILE_KEYS * (D + vec) * q.dtype.itemsize  # two stages of K and V tiles, padded rows
        kernels.launch(
            file,
            f"flash_decoding_kernel<{cxx}>",
            (S, Hq, splits),
            (32,),
            (*common[:6], partial_out, partial_max, partial_sum, *common[6:], i32(partition_keys)),
            shared_mem=stages + 4 * D,
        )
        if splits > 1:
            kernels.launch(
                file,
                f"merge_splits_kernel<{cxx}>",
                (S, Hq),
                (128,),
                (
                    partial_out,
                    partial_max,
                    partial_sum,
                    lens,
                    out,
                    i32(Hq),
                    i32(D),
                    i32(splits),
                    i32(partition_keys),
                ),
            )
    return out


def random_case(
    xp,
    dtype: str,
    seqs: int,
    context: int,
    new_tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
):
    """(q [T, Hq, D], k_cache, v_cache, batch): `seqs` sequences of `context` keys whose last `new_tokens` are
    this step's queries, blocks scattered over a shuffled pool; standard normal values stored as dtype."""
    runs = [(context - new_tokens, new_tokens)] * seqs
    batch, num_blocks = scattered_batch(np.random.default_rng(seed), runs, block_size)
    state = xp.random.RandomState(seed)

    def normal(*shape):
        return convert(state.standard_normal(shape).astype(np.float32), "float32", dtype)

    cache = (num_blocks, kv_heads, block_size, head_dim)
    return normal(batch.num_tokens, heads, head_dim), normal(*cache), normal(*cache), batch


def median_ms(xp, run, iterations: int) -> float:
    """Median milliseconds of run() over `iterations` launches after one warm-up (GPU events on CuPy)."""
    run()
    times = []
    for _ in range(iterations):
        if xp is np:
            start = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - start))
        else:
            begin, end = xp.cuda.Event(), xp.cuda.Event()
            begin.record()
            run()
            end.record()
            end.synchronize()
            times.append(xp.cuda.get_elapsed_time(begin, end))
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cuda-emulated"), default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="timed launches per kernel (default: 20 on a GPU, 1 on the emulator)",
    )
    args = parser.parse_args(argv)
    kernels = LearnKernels(args.device)
    xp = kernels.xp
    shape = DECODE if args.device == "cuda" else EMULATED
    iterations = args.iterations or (20 if args.device == "cuda" else 1)
    ops = cuda_ops.gpu(args.dtype) if args.device == "cuda" else cuda_ops.emulated(args.dtype)
    cases = {"decode": shape, "prefill": {**shape, "new_tokens": PREFILL_TOKENS[args.device]}}
    for shape_name, case in cases.items():
        steps = list(STEPS) if shape_name == "decode" else ["04_tensor_core"]
        q, k_cache, v_cache, batch = random_case(xp, args.dtype, **case)
        kv_bytes = 2 * case["seqs"] * case["kv_heads"] * case["context"] * case["head_dim"] * q.dtype.itemsize
        scale = case["head_dim"] ** -0.5
        for kernel, run in launches(kernels, ops, steps, q, k_cache, v_cache, batch, scale).items():
            ms = median_ms(xp, run, iterations)
            row = {
                "kernel": kernel,
                "shape": shape_name,
                "device": args.device,
                "dtype": args.dtype,
                **case,
                "ms": round(ms, 4),
                "kv_gb_per_s": float(f"{kv_bytes / ms / 1e6:.4g}"),
            }
            print(json.dumps(row), flush=True)


def launches(
    kernels: LearnKernels, ops, steps: list[str], q, k_cache, v_cache, batch: Batch, scale: float
) -> dict:
    """Kernel name -> a function that launches it on this case: the steps, then the production op."""
    runs = {
        step: functools.partial(attend, kernels, step, q, k_cache, v_cache, batch, scale) for step in steps
    }
    runs["production"] = functools.partial(ops.paged_attention, q, k_cache, v_cache, batch, scale)
    return runs


if __name__ == "__main__":
    main()
