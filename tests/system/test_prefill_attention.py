"""cuda/prefill_attention.cu (tensor cores: ldmatrix + mma.sync, 128-row tiles, cp.async stages, key splits
merged by paged_attention_reduce_kernel) on the CPU emulator against ReferenceOps, at the edge sizes.

CI runs a subset (every head_dim and both 16-bit types once; the edge sizes on bfloat16, head_dim 64) under
two fiber orders; `python bench/attention_matrix.py` runs the whole matrix.
"""

from __future__ import annotations

import dataclasses
import mmap
import platform

import numpy as np
import pytest

from minisarathi.backends import cuda_ops, emulator
from minisarathi.backends.reference import ReferenceOps
from minisarathi.dtypes import bf16_to_float32, float32_to_bf16
from minisarathi.testing import scattered_batch

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)
TOLERANCE = {"float16": 1e-3, "bfloat16": 8e-3}  # relative to the output's scale; P is rounded to the type


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
    k_cache, v_cache = (
        on_device(rng.standard_normal(shape), dtype),
        on_device(rng.standard_normal(shape), dtype),
    )
    q = on_device(rng.standard_normal((batch.num_tokens, Hq, D)), dtype)
    return batch, q, k_cache, v_cache


def check(dtype, Hq, Hk, D, block_size, runs, seed=0, splits=None):
    """Prefill rows from the prefill kernel alone (other rows must stay untouched; `splits` key splits, or
    the kernel's choice), then the whole mixed batch through CudaOps.paged_attention (prefill + decode
    launches), both against ReferenceOps."""
    batch, q, k_cache, v_cache = attention_case(seed, dtype, Hq, Hk, D, block_size, runs)
    ops = cuda_ops.emulated(dtype)
    scale = 1 / np.sqrt(D)
    expected = ReferenceOps().paged_attention(
        as_float32(q), as_float32(k_cache), as_float32(v_cache), batch, scale
    )
    atol = TOLERANCE[dtype] * max(1.0, float(np.abs(expected).max()))
    prefill_rows = np.repeat(np.diff(batch.query_start) > 1, np.diff(batch.query_start))

    out = on_device(np.full(q.shape, np.nan, np.float32), dtype)
    ops._prefill_attention(q, k_cache, v_cache, batch, scale, out, np.int32(0), splits)
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
    "odd chunks over 128-row tiles": [(7, 67), (0, 129), (13, 3)],
    "history 0 and longer than the chunk": [(0, 5), (150, 3)],
}


@pytest.mark.parametrize("runs", EDGE_RUNS.values(), ids=EDGE_RUNS.keys())
def test_edge_sizes(order, runs):
    check("bfloat16", 8, 2, 64, 16, runs)


@pytest.mark.parametrize("Hq, Hk", [(2, 2), (4, 2), (8, 2), (8, 1)], ids=["GQA1", "GQA2", "GQA4", "GQA8"])
def test_gqa_groups(order, Hq, Hk):
    # Odd block size: keys straddle blocks at every offset. A CTA's 128 rows are 128 / G tokens: the 133-token
    # chunk fills whole CTAs plus a ragged last one at every G (G = 8: 8 full CTAs of 16 tokens and 5 tokens).
    check("bfloat16", Hq, Hk, 64, 5, [(9, 16), (0, 133)], seed=1)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_key_splits(order, splits):
    """Forced key splits (the merge through paged_attention_reduce_kernel) give the unsplit result: a chunk
    over 300 keys of history (split boundaries inside the history and at the diagonal), a chunk of 2 at a
    split boundary, one that ends before the last split starts, and a decode (decode_attention's row)."""
    check("bfloat16", 8, 2, 64, 16, [(300, 37), (126, 2), (5, 20), (40, 1)], seed=3, splits=splits)


def test_small_grid_splits_itself(monkeypatch):
    """One CTA per KV head over 1,100 keys: the kernel's own choice splits it (2 splits of 576 keys)."""
    chosen = []
    choose = cuda_ops._prefill_splits
    monkeypatch.setattr(cuda_ops, "_prefill_splits", lambda *args: chosen.append(choose(*args)) or chosen[-1])
    check("bfloat16", 4, 2, 64, 16, [(1100, 5), (0, 1)], seed=6)
    assert chosen == [2, 2]  # the kernel alone, then inside the mixed-batch op


def test_key_splits_at_head_dim_128():
    # Two 32-key softmax steps per tile (pf_softmax_keys) under split partials.
    check("float16", 4, 1, 128, 16, [(150, 33)], seed=4, splits=2)


def test_split_choice():
    """Splits only for grids under 2 waves whose last wave is mostly empty, at 512 keys a split or more."""
    sms = 132  # H100/H200: 264 resident CTAs
    assert cuda_ops._prefill_splits(8 * 512 // 32, 8192 // 64 + 8, sms) == 5  # 512 tokens, GQA 4, 8k history
    assert (
        cuda_ops._prefill_splits(8 * 2048 // 32, 8192 // 64 + 32, sms) == 1
    )  # 2048 tokens: 512 CTAs, 1.94 waves
    assert cuda_ops._prefill_splits(8 * 512 // 32, 8, sms) == 1  # no history: 8 tiles, nothing to split
    assert cuda_ops._prefill_splits(4, 20, sms) == 2  # 1280 keys: two splits of 640


def test_strided_query_view(order):
    """Q as a row-strided view of a fused QKV array, as the model passes it."""
    batch, q, k_cache, v_cache = attention_case(2, "float16", 4, 2, 64, 16, [(10, 12)])
    qkv = np.zeros((q.shape[0], 8, 64), np.float16)
    qkv[:, :4] = q
    ops = cuda_ops.emulated("float16")
    out = ops.paged_attention(qkv[:, :4], k_cache, v_cache, batch, 0.125)
    np.testing.assert_array_equal(out, ops.paged_attention(q, k_cache, v_cache, batch, 0.125))


def reserved_only(shape, dtype=np.uint16):
    """A zeroed array of `shape` backed by address space only (MAP_NORESERVE): pages cost memory once
    written."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mapping = mmap.mmap(
        -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000
    )  # 0x4000: MAP_NORESERVE
    return np.frombuffer(mapping, dtype=dtype).reshape(shape)


def test_cache_rows_past_int32():
    """A cache of more than 2^31 key rows (num_blocks x Hk x block_size): the sequences' blocks sit at its
    end, rows on both sides of 2^31, which a 32-bit row index would wrap (this test's failure before the
    kernel's rows became 64-bit). 64 GiB of address space per cache at D = 16, of which a few blocks are
    written."""
    dtype, Hq, Hk, D, block_size = "bfloat16", 4, 1, 16, 16
    batch, q, k_small, v_small = attention_case(5, dtype, Hq, Hk, D, block_size, [(40, 30), (0, 9), (3, 1)])
    base = 2**31 // (Hk * block_size) - 2  # block base + 2 starts at row 2^31
    shape = (base + k_small.shape[0], Hk, block_size, D)
    k_cache, v_cache = reserved_only(shape), reserved_only(shape)
    k_cache[base:], v_cache[base:] = k_small, v_small
    far = dataclasses.replace(batch, block_tables=batch.block_tables + np.int32(base))
    scale = 1 / np.sqrt(D)
    expected = ReferenceOps().paged_attention(
        as_float32(q), as_float32(k_small), as_float32(v_small), batch, scale
    )
    prefill_rows = np.repeat(np.diff(batch.query_start) > 1, np.diff(batch.query_start))
    out = on_device(np.full(q.shape, np.nan, np.float32), dtype)
    cuda_ops.emulated(dtype)._prefill_attention(q, k_cache, v_cache, far, scale, out, np.int32(0))
    np.testing.assert_allclose(
        as_float32(out)[prefill_rows],
        expected[prefill_rows],
        rtol=0,
        atol=TOLERANCE[dtype] * max(1.0, float(np.abs(expected).max())),
    )
