"""Decode attention over the paged KV cache: alternative NumPy formulations timed side by side.

    python -m bench.decode_attention_variants            # the shapes of the bundled, tiny, small and 2048 models
    python -m bench.decode_attention_variants --repeats 20

Every variant computes the same float32[S, Hk, G, D] for S decoding sequences whose blocks are scattered
over a shuffled pool of [num_blocks, Hk, block_size, D] caches; all are checked against the first before
timing, then timed in turns (best of --repeats, CPU time of this thread, one BLAS thread, the process set up as
the engine sets it up) so
that load from other processes falls on all alike. A step is NUM_LAYERS calls on one batch. The last
variants are the backend's (CpuOps.store_kv of one token per sequence, then paged_attention, per layer):
on its first step (everything copied) and on the steps after (decode K/V kept; only the blocks written
since are copied again), with its decodes on the native kernel where it runs here (cpu_attention.py; "first
step" and "next steps"), and on NumPy's path ("NumPy decodes, next steps"). Prints one JSON line per shape and
variant.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

from minisarathi.backends.cpu import native_attention
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.cpu.process_setup import configure_cpu
from minisarathi.testing import ScheduledChunk, build_batch

# name: (Hk, G, D, S, context)
SHAPES = {"stories260K": (4, 2, 8, 32, 160), "tiny": (4, 2, 32, 32, 160), "small": (4, 2, 64, 32, 160),
          "2048@512": (8, 4, 64, 32, 512), "tiny@512": (4, 2, 32, 32, 512),
          "small@1024": (4, 2, 64, 32, 1024), "llama@512": (8, 4, 128, 32, 512)}
BLOCK_SIZE = 16
NUM_LAYERS = 4   # calls per step: the per-batch work of the planned variants is paid once for these


def exp_in_place(scores):
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    return scores.sum(axis=-1, keepdims=True)


def blockwise(q, k_cache, v_cache, tables, context_lens):
    """The original: whole blocks gathered to [S, nb, Hk, bs, D], products block by block."""
    S, Hk, G, D = q.shape
    bs = k_cache.shape[2]
    nb = -(-int(context_lens.max()) // bs)
    n = nb * bs
    k = np.take(k_cache, tables[:, :nb], axis=0)
    v = np.take(v_cache, tables[:, :nb], axis=0)
    scores = q[:, None] @ k.swapaxes(-1, -2)
    scores = scores.transpose(0, 2, 3, 1, 4).reshape(S, Hk, G, n)
    padding = np.arange(n) >= context_lens[:, None]
    scores += np.where(padding, np.float32(-np.inf), np.float32(0))[:, None, None, :]
    den = exp_in_place(scores)
    probs = scores.reshape(S, Hk, G, nb, bs).transpose(0, 3, 1, 2, 4)
    out = (probs @ v).sum(axis=1)
    out /= den
    return out


class Plan:
    """What every layer of one step shares: the (block, head) tile index and the padding mask."""

    def __init__(self, k_cache, tables, context_lens):
        Hk, bs = k_cache.shape[1], k_cache.shape[2]
        self.nb = -(-int(context_lens.max()) // bs)
        n = self.nb * bs
        # tile (b, h) of the cache seen as [num_blocks * Hk, bs, D] is block b's head h
        self.tiles = (tables[:, None, :self.nb] * Hk + np.arange(Hk, dtype=tables.dtype)[:, None]).ravel()
        self.mask = np.where(np.arange(n) >= context_lens[:, None], np.float32(-np.inf),
                             np.float32(0))[:, None, None, :]      # float32[S, 1, 1, n]
        self.buffers = {}


def gather_heads(cache, plan, S, out=None):
    NB, Hk, bs, D = cache.shape
    tiles = cache.reshape(NB * Hk, bs, D)
    if out is None:
        k = np.take(tiles, plan.tiles, axis=0)
    else:
        k = np.take(tiles, plan.tiles, axis=0, out=out, mode="clip")  # "raise" would buffer the output
    return k.reshape(S, Hk, plan.nb * bs, D)


def head_major(q, k_cache, v_cache, tables, context_lens, plan=None, reuse=False):
    """Tiles gathered straight into [S, Hk, n, D]: one matmul per (sequence, head), no reordering."""
    S = q.shape[0]
    plan = plan or Plan(k_cache, tables, context_lens)
    outs = (None, None)
    if reuse:
        size = len(plan.tiles)
        if plan.buffers.get("size") != size:
            shape = (size,) + k_cache.shape[2:]
            plan.buffers = {"size": size, "k": np.empty(shape, np.float32), "v": np.empty(shape, np.float32)}
        outs = plan.buffers["k"], plan.buffers["v"]
    k = gather_heads(k_cache, plan, S, outs[0])
    v = gather_heads(v_cache, plan, S, outs[1])
    scores = q @ k.swapaxes(-1, -2)                                    # float32[S, Hk, G, n]
    scores += plan.mask
    den = exp_in_place(scores)
    out = scores @ v                                                   # float32[S, Hk, G, D]
    out /= den
    return out


def head_major_einsum(q, k_cache, v_cache, tables, context_lens, plan=None):
    S = q.shape[0]
    plan = plan or Plan(k_cache, tables, context_lens)
    k = gather_heads(k_cache, plan, S)
    v = gather_heads(v_cache, plan, S)
    scores = np.einsum("shgd,shnd->shgn", q, k)
    scores += plan.mask
    den = exp_in_place(scores)
    out = np.einsum("shgn,shnd->shgd", scores, v)
    out /= den
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    print(configure_cpu(1).describe(), file=sys.stderr)   # as the engine; one thread: its CPU time is the work
    for name in args.shapes.split(","):
        Hk, G, D, S, context = SHAPES[name]
        rng = np.random.default_rng(0)
        nb = -(-context // BLOCK_SIZE)
        num_blocks = S * nb + 7
        # one (k_cache, v_cache) per layer, as in a model
        caches = [tuple(rng.standard_normal((num_blocks, Hk, BLOCK_SIZE, D), dtype=np.float32) for _ in range(2))
                  for _ in range(NUM_LAYERS)]
        k_cache, v_cache = caches[0]
        tables = rng.permutation(num_blocks)[:S * nb].reshape(S, nb).astype(np.int32)
        context_lens = rng.integers(context - 2 * BLOCK_SIZE, context + 1, S).astype(np.int32)
        batch = build_batch([ScheduledChunk([5], int(n) - 1, t.tolist(), True) for n, t in zip(context_lens, tables)],
                            BLOCK_SIZE)
        q = rng.standard_normal((S, Hk, G, D), dtype=np.float32) * np.float32(D ** -0.5)
        args_ = (q, k_cache, v_cache, tables, context_lens)

        def per_step(fn, planned=False, **kw):
            def run():
                plan = Plan(k_cache, tables, context_lens) if planned else None
                for k, v in caches:
                    fn(q, k, v, tables, context_lens, plan=plan, **kw) if planned else \
                        fn(q, k, v, tables, context_lens, **kw)
            return run

        new_token = rng.standard_normal((S, Hk, D), dtype=np.float32)
        kept_ops = CpuOps()

        def backend_step(ops=None):
            """A decode step: every layer writes one token per sequence (store_kv), then attends.
            ops None: a fresh backend (all K/V copied); else the same one from step to step (K/V kept)."""
            ops, step_batch = ops or CpuOps(), dataclasses.replace(batch)   # a new batch: a new plan
            for k, v in caches:
                ops.store_kv(new_token, new_token, k, v, step_batch.slot_mapping)
                ops.paged_attention(q.reshape(S, Hk * G, D), k, v, step_batch, 1.0)
        numpy_ops = CpuOps()

        def numpy_backend_step():
            """backend_step(kept ops) with NumPy's decode path, as where the native kernel does not run."""
            runs, native_attention.runs = native_attention.runs, lambda head_dim: False
            try:
                backend_step(numpy_ops)
            finally:
                native_attention.runs = runs
        variants = {
            "blockwise (original)": (blockwise, {}, False),
            "head-major gather": (head_major, {}, False),
            "head-major, plan per step": (head_major, {}, True),
            "head-major, plan + reused buffers": (head_major, {"reuse": True}, True),
            "head-major einsum, plan": (head_major_einsum, {}, True),
        }
        want = blockwise(*args_)
        for label, (fn, kw, planned) in variants.items():
            got = fn(*args_, plan=Plan(k_cache, tables, context_lens), **kw) if planned else fn(*args_, **kw)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=label)
        got = CpuOps().paged_attention(q.reshape(S, Hk * G, D), k_cache, v_cache, batch, 1.0)
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-6, err_msg="backend")
        fns = [per_step(fn, planned, **kw) for fn, kw, planned in variants.values()]
        fns += [backend_step, lambda: backend_step(kept_ops), numpy_backend_step]
        labels = [*variants, "backend, first step", "backend, next steps", "backend, NumPy decodes, next steps"]
        for fn in fns:
            fn()
        best = [float("inf")] * len(fns)
        for _ in range(args.repeats):
            for i, fn in enumerate(fns):
                start = time.thread_time()
                fn()
                best[i] = min(best[i], time.thread_time() - start)
        for label, t in zip(labels, best):
            print(json.dumps({"bench": "decode_attention", "shape": name, "Hk": Hk, "G": G, "D": D, "S": S,
                              "context": context, "variant": label, "layers": NUM_LAYERS,
                              "ms_per_step": round(t * 1e3, 3), "vs_original": round(t / best[0], 3)}), flush=True)


if __name__ == "__main__":
    main()
