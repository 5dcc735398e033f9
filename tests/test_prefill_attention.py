"""cuda/prefill_attention.cu (tensor cores: ldmatrix + mma.sync, cp.async double buffering) on the CPU
emulator against the NumPy reference, at the edge sizes.

CI runs a subset (every head_dim and both 16-bit types once; the edge sizes on bfloat16, head_dim 64) under
two fiber orders; `python bench/attention_matrix.py` runs the whole matrix.
"""
from __future__ import annotations

import platform

import numpy as np
import pytest

from minisarathi.backends import cuda_ops, emulator
from minisarathi.backends.numpy_ops import NumpyOps
from minisarathi.dtypes import bf16_to_float32, float32_to_bf16
from minisarathi.testing import scattered_batch

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only")
TOLERANCE = {"float16": 1e-3, "bfloat16": 8e-3}   # relative to the output's scale; P is rounded to the type


@pytest.fixture(params=["forward", "reverse"])
def order(request):
    with emulator.schedule(request.param):
        yield request.param


def on_device(x: np.ndarray, dtype: str) -> np.ndarray:
    return float32_to_bf16(x) if dtype == "bfloat16" else x.astype(np.float16)


def as_float32(x: np.ndarray) -> np.ndarray:
    return bf16_to_float32(x) if x.dtype == np.uint16 else x.astype(np.float32)


def attention_case(seed: int, dtype: str, Hq: int, Hk: int, D: int, block_size: int, runs):
    """runs: (history, new tokens) per sequence; blocks scattered over a shuffled pool with spare blocks."""
    rng = np.random.default_rng(seed)
    batch, num_blocks = scattered_batch(rng, runs, block_size)
    shape = (num_blocks, Hk, block_size, D)
    k_cache, v_cache = on_device(rng.standard_normal(shape), dtype), on_device(rng.standard_normal(shape), dtype)
    q = on_device(rng.standard_normal((batch.num_tokens, Hq, D)), dtype)
    return batch, q, k_cache, v_cache


def check(dtype, Hq, Hk, D, block_size, runs, seed=0):
    """Prefill rows from the prefill kernel alone (other rows must stay untouched), then the whole mixed
    batch through CudaOps.paged_attention (prefill + decode launches), both against NumPy."""
    batch, q, k_cache, v_cache = attention_case(seed, dtype, Hq, Hk, D, block_size, runs)
    ops = cuda_ops.emulated(dtype)
    scale = 1 / np.sqrt(D)
    expected = NumpyOps().paged_attention(as_float32(q), as_float32(k_cache), as_float32(v_cache), batch, scale)
    atol = TOLERANCE[dtype] * max(1.0, float(np.abs(expected).max()))
    prefill_rows = np.repeat(np.diff(batch.query_start) > 1, np.diff(batch.query_start))

    out = on_device(np.full(q.shape, np.nan, np.float32), dtype)
    ops._prefill_attention(q, k_cache, v_cache, batch, scale, out)
    np.testing.assert_allclose(as_float32(out)[prefill_rows], expected[prefill_rows], rtol=0, atol=atol)
    assert np.isnan(as_float32(out)[~prefill_rows]).all()

    out = ops.paged_attention(q, k_cache, v_cache, batch, scale)
    np.testing.assert_allclose(as_float32(out), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", cuda_ops.PREFILL_HEAD_DIMS)
def test_every_head_dim_and_type(dtype, D):
    # A chunk from 0 longer than a tile, a chunk over a history, and a decode, GQA 2.
    check(dtype, 4, 2, D, 16, [(0, 70), (37, 9), (20, 1)])


EDGE_RUNS = {
    "chunk of 2 at the start": [(0, 2)],
    "block boundaries": [(16, 16), (15, 2), (31, 1)],
    "chunks not a multiple of the tile, with decodes": [(0, 65), (3, 66), (64, 1), (0, 1)],
    "history 0 and longer than the chunk": [(0, 5), (150, 3)],
}


@pytest.mark.parametrize("runs", EDGE_RUNS.values(), ids=EDGE_RUNS.keys())
def test_edge_sizes(order, runs):
    check("bfloat16", 8, 2, 64, 16, runs)


@pytest.mark.parametrize("Hq, Hk", [(2, 2), (8, 2), (8, 1)], ids=["GQA1", "GQA4", "GQA8"])
def test_gqa_groups(order, Hq, Hk):
    # Odd block size: keys straddle blocks at every offset; 8 tokens x G = 64 rows fills a CTA for G = 8.
    check("bfloat16", Hq, Hk, 64, 5, [(9, 8), (0, 23)], seed=1)


def test_strided_query_view(order):
    """Q as a row-strided view of a fused QKV array, as the model passes it."""
    batch, q, k_cache, v_cache = attention_case(2, "float16", 4, 2, 64, 16, [(10, 12)])
    qkv = np.zeros((q.shape[0], 8, 64), np.float16)
    qkv[:, :4] = q
    ops = cuda_ops.emulated("float16")
    out = ops.paged_attention(qkv[:, :4], k_cache, v_cache, batch, 0.125)
    np.testing.assert_array_equal(out, ops.paged_attention(q, k_cache, v_cache, batch, 0.125))
