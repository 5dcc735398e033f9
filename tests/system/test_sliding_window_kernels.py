"""Sliding-window attention in the CUDA kernels on the CPU emulator, against ReferenceOps: decode_attention.cu
(splits and their merge), prefill_attention.cu (tensor cores, key splits) and paged_attention.cu (float32
chunks, partitions and their merge). The block-table entries before each sequence's first window are -1, as
the block manager leaves freed blocks: a kernel that read them would fail. Negative control: the same batch
without the window is far from the windowed result."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from minisarathi.backends import cuda_ops
from minisarathi.backends.reference import ReferenceOps
from minisarathi.dtypes import bf16_to_float32, float32_to_bf16
from minisarathi.testing import scattered_batch

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)
TOLERANCE = {"float32": 1e-5, "bfloat16": 8e-3}  # relative to the output's scale


def on_device(x: np.ndarray, dtype: str) -> np.ndarray:
    return float32_to_bf16(x) if dtype == "bfloat16" else x.astype(np.float32)


def as_float32(x: np.ndarray) -> np.ndarray:
    return bf16_to_float32(x) if x.dtype == np.uint16 else x.astype(np.float32)


def windowed_case(dtype, Hq, Hk, D, block_size, runs, window, seed=0):
    """A scattered batch whose blocks wholly before each sequence's first query window are freed (-1)."""
    rng = np.random.default_rng(seed)
    batch, num_blocks = scattered_batch(rng, runs, block_size)
    for s, (history, _) in enumerate(runs):
        batch.block_tables[s, : max(0, (history - window + 1) // block_size)] = -1
    shape = (num_blocks, Hk, block_size, D)
    k_cache, v_cache = (on_device(rng.standard_normal(shape), dtype) for _ in range(2))
    q = on_device(rng.standard_normal((batch.num_tokens, Hq, D)), dtype)
    return batch, q, k_cache, v_cache


def check(dtype, Hq, Hk, D, block_size, runs, window, prefill_splits=None):
    batch, q, k_cache, v_cache = windowed_case(dtype, Hq, Hk, D, block_size, runs, window)
    ops, scale = cuda_ops.emulated(dtype), D**-0.5
    host = [as_float32(x) for x in (q, k_cache, v_cache)]
    expected = ReferenceOps().paged_attention(*host, batch, scale, window)
    atol = TOLERANCE[dtype] * max(1.0, float(np.abs(expected).max()))
    if prefill_splits is None:
        out = ops.paged_attention(q, k_cache, v_cache, batch, scale, window)
        rows = slice(None)
    else:
        out = on_device(np.zeros(q.shape, np.float32), dtype)
        ops._prefill_attention(q, k_cache, v_cache, batch, scale, out, np.int32(window), prefill_splits)
        rows = np.repeat(np.diff(batch.query_start) > 1, np.diff(batch.query_start))
    np.testing.assert_allclose(as_float32(out)[rows], expected[rows], rtol=0, atol=atol)
    full = np.array(batch.block_tables)
    full[full < 0] = 0  # without the window, the freed entries would be read: any block will do here
    batch.block_tables = full
    unwindowed = ReferenceOps().paged_attention(*host, batch, scale)
    assert np.abs(unwindowed[rows] - expected[rows]).max() > 10 * atol


@pytest.mark.parametrize("window", [100, 700])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_kernel(dtype, window):
    """Decodes of contexts longer than the window, shorter than it, and at its edge; the window of 700
    is cut into splits (merged by decode_attention_reduce_kernel) that begin past key 0."""
    assert cuda_ops.decode_plan.supports(dtype, 2 if dtype == "bfloat16" else 4, 8, 2, 64, 16, 200)
    contexts = [(1500, 1), (600, 1), (70, 1), (5, 1), (window - 1, 1), (window, 1)]
    check(dtype, 8, 2, 64, 16, contexts, window)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_prefill_kernel(splits):
    """Chunks over a history longer than the window (split boundaries inside it and before it), a chunk
    shorter than the window, and one longer than it from position 0."""
    check(
        "bfloat16", 8, 2, 64, 16, [(300, 37), (126, 2), (5, 20), (0, 150)], window=70, prefill_splits=splits
    )


@pytest.mark.parametrize("window", [300, 600])
def test_chunk_kernel_over_partitions(window):
    """float32 chunks (paged_attention.cu): contexts over several 512-key partitions, windows inside one
    partition and straddling two."""
    check("float32", 4, 2, 16, 16, [(700, 5), (1100, 3), (20, 9)], window)
