"""cuda/decode_attention.cu (flash-decoding over the paged cache) on the emulator against NumPy, and its plan.

CI runs a subset of the edge-size matrix: every head_dim and dtype once, the edge sizes (context 1, block
boundaries, uneven splits, GQA 1/4/6/8/16, block sizes 1/8/16/32, scattered block tables) on bf16 at
head_dim 64, each under two fiber orders. `python -m bench.decode_attention_matrix` runs the whole matrix.
"""
from __future__ import annotations

import platform

import numpy as np
import pytest

from minisarathi.backends import cuda_ops, decode_plan, emulator
from minisarathi.backends.numpy_ops import NumpyOps
from minisarathi.dtypes import DTYPES, STORAGE_DTYPES, bf16_to_float32, float32_to_bf16
from minisarathi.testing import scattered_batch

emulated_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only")
TOLERANCE = {"float32": 2e-5, "float16": 1e-3, "bfloat16": 8e-3}   # relative to the values' scale


def on_device(x, dtype):
    return float32_to_bf16(x) if dtype == "bfloat16" else np.asarray(x, dtype=STORAGE_DTYPES[dtype])


def as_float32(x):
    return bf16_to_float32(x) if x.dtype == np.uint16 else x.astype(np.float32)


def decode_case(rng, dtype, Hq, Hk, D, block_size, runs, fused_qkv=False):
    """runs: (cached tokens, new tokens) per sequence; blocks scattered over a shuffled pool with spares.
    With fused_qkv, q is a row-strided view into a [T, (Hq + 2 Hk) D] array, as the model passes it."""
    batch, num_blocks = scattered_batch(rng, runs, block_size)
    shape = (num_blocks, Hk, block_size, D)
    k_cache, v_cache = on_device(rng.standard_normal(shape), dtype), on_device(rng.standard_normal(shape), dtype)
    width = (Hq + 2 * Hk) * D if fused_qkv else Hq * D
    q = on_device(rng.standard_normal((batch.num_tokens, width)), dtype)[:, :Hq * D].reshape(-1, Hq, D)
    return batch, q, k_cache, v_cache


def check(dtype, Hq, Hk, D, block_size, contexts, order, seed=0, fused_qkv=False, prefills=()):
    ops, rng = cuda_ops.emulated(dtype), np.random.default_rng(seed)
    runs = [(c - 1, 1) for c in contexts] + list(prefills)
    batch, q, k_cache, v_cache = decode_case(rng, dtype, Hq, Hk, D, block_size, runs, fused_qkv)
    launched = []
    kernel = ops.launcher.kernel
    ops.launcher.kernel = lambda file, name: launched.append(name) or kernel(file, name)
    with emulator.schedule(order, seed=seed):
        out = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
    expected = NumpyOps().paged_attention(as_float32(q), as_float32(k_cache), as_float32(v_cache), batch, 0.3)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(as_float32(out), expected, rtol=0, atol=TOLERANCE[dtype] * scale)
    return launched


@pytest.fixture(params=["forward", "reverse"])
def order(request):
    return request.param


@emulated_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_every_dtype_and_head_dim(order, dtype, head_dim):
    contexts = [1, 16, 17, 130]          # one key; a block boundary and one past it; three uneven splits
    launched = check(dtype, 8, 2, head_dim, 16, contexts, order, fused_qkv=head_dim == 128)
    assert any(n.startswith("decode_attention_kernel") for n in launched)
    assert not any(n.startswith("paged_attention") for n in launched)   # every row was a decode


EDGE_CASES = {  # Hq, Hk, block_size, contexts
    "mha-bs1": (4, 4, 1, [1, 2, 31, 32, 33, 97]),
    "gqa4-bs8": (8, 2, 8, [1, 8, 9, 15, 64, 65, 200]),
    "gqa8-bs32": (16, 2, 32, [1, 32, 33, 63, 129, 300]),
    "gqa6-bs16": (12, 2, 16, [3, 16, 48, 100]),        # a group that is not a power of two
    "gqa16-bs16": (16, 1, 16, [5, 77]),                # two CTAs per KV head (group tile 8)
}


@emulated_only
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_sizes(order, case):
    Hq, Hk, block_size, contexts = EDGE_CASES[case]
    check("bfloat16", Hq, Hk, 64, block_size, contexts, order, seed=len(case))


@emulated_only
def test_float32_group_of_8_takes_two_ctas_per_kv_head(order):
    check("float32", 16, 2, 64, 16, [1, 40, 150], order)


@emulated_only
@pytest.mark.parametrize("dtype, prefill_kernel", [("float32", "paged_attention_reduce_kernel"),
                                                   ("bfloat16", "prefill_attention_kernel")])
def test_mixed_batch_launches_over_disjoint_rows(order, dtype, prefill_kernel):
    """Decodes (one past 512 keys) next to prefill chunks (one split into paged_attention's partitions in
    float32, on tensor cores in bf16): each kernel writes only its own rows."""
    launched = check(dtype, 8, 2, 64, 16, [1, 600, 33], order, prefills=[(520, 7), (0, 5)])
    assert any(n.startswith("decode_attention_kernel") for n in launched)
    assert any(n.startswith(prefill_kernel) for n in launched)


@emulated_only
def test_shapes_the_decode_kernel_does_not_take_stay_on_paged_attention():
    # 24-byte key rows (not whole 16-byte chunks), a block size that is not a power of two, and 32-byte rows
    # (2 lanes per key) for a CTA of 4 query heads.
    for dtype, D, block_size in [("bfloat16", 12, 16), ("float32", 16, 5), ("bfloat16", 16, 16)]:
        launched = check(dtype, 4, 2, D, block_size, [1, 7, 40], "forward")
        assert not any(n.startswith("decode_attention") for n in launched)


# ---- the plan (host side) -----------------------------------------------------------------------------

def plan_for(contexts, Hq=32, Hk=8, D=128, dtype="bfloat16", block_size=16, sms=132):
    n = len(contexts)
    rows = np.arange(n, dtype=np.int32)
    return decode_plan.plan(rows * 3, rows, np.array(contexts, np.int32), Hq, Hk, D, dtype,
                            2 if dtype != "float32" else 4, block_size, sms)


@pytest.mark.parametrize("contexts", [[4096] * 64, [512], [32768], [1, 64, 65, 130, 2047, 5000, 33]])
def test_plan_covers_each_row_once_and_sizes_partials_by_the_rows_that_split(contexts):
    plan = plan_for(contexts)
    token, seq, begin, end, slot = plan.items.T
    for r, length in enumerate(contexts):
        mine = seq == r
        assert (token[mine] == 3 * r).all()
        spans = sorted(zip(begin[mine], end[mine]))
        assert spans[0][0] == 0 and spans[-1][1] == length                        # nothing past the row's end
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))               # contiguous, no overlap
        assert all(e > b for b, e in spans)
        assert (slot[mine] == -1).all() == (mine.sum() == 1)                     # unsplit rows own no slot
    split = slot >= 0
    assert sorted(slot[split]) == list(range(plan.num_slots))                   # each slot written once
    assert plan.num_slots == sum(plan.rows[:, 2]) and len(plan.rows) == sum(np.bincount(seq) > 1)
    assert (end - begin <= max(plan.split_keys, decode_plan.SPLIT_ALIGN)).all()


def test_plan_fills_the_gpu():
    wave = 132 * decode_plan.CTAS_PER_MULTIPROCESSOR
    big, long_one, short_one = plan_for([4096] * 64), plan_for([32768]), plan_for([512])
    for plan in (big, long_one):
        assert len(plan.items) * 8 >= 2 * wave * 0.9                             # about two waves or more
        assert (plan.items[:, 3] - plan.items[:, 2]).min() >= decode_plan.MIN_SPLIT_KEYS
    assert len(long_one.items) >= 100                                           # one sequence, many splits
    assert (short_one.items[:, 3] - short_one.items[:, 2] == 64).all()          # no split under 64 keys
    assert plan_for([100] * 4, Hq=32, Hk=2).group_tile == 8 and plan_for([100], Hq=8, Hk=8).group_tile == 4
    assert plan_for([100], Hq=32, Hk=2).head_chunks == 2


# ---- a graph bucket's plan: made for the block tables' capacity, ended by each row's length on the device ----

def bucket_case(dtype, contexts, capacity, block_size=16, seed=0):
    """A decode batch whose block tables are widened to `capacity` keys (zeros past each row's blocks) and
    whose attention is planned for `capacity` keys in every row, as decode_graphs.pad_to_bucket makes it."""
    rng = np.random.default_rng(seed)
    batch, q, k_cache, v_cache = decode_case(rng, dtype, 8, 2, 64, block_size, [(c - 1, 1) for c in contexts])
    tables = np.zeros((len(contexts), capacity // block_size), np.int32)
    tables[:, :batch.block_tables.shape[1]] = batch.block_tables
    batch.block_tables, batch.plan_context_len = tables, capacity
    return batch, q, k_cache, v_cache


@emulated_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bucket_plan_skips_the_splits_past_each_row(order, dtype):
    """Rows of 1 to 300 keys under a plan for 1024: most splits lie past their row's end; their CTAs exit
    and the reduce merges only the others. Negative control: the same launch told every row is 1024 keys long
    attends to the zero table entries' keys and differs."""
    batch, q, k_cache, v_cache = bucket_case(dtype, [1, 17, 64, 65, 300], 1024)
    ops = cuda_ops.emulated(dtype)
    plan = plan_for([1024] * batch.num_seqs, Hq=8, Hk=2, D=64, dtype=dtype)   # what the bucket's launch runs
    assert len(plan.items) >= 4 * batch.num_seqs
    with emulator.schedule(order):
        out = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
    expected = NumpyOps().paged_attention(as_float32(q), as_float32(k_cache), as_float32(v_cache), batch, 0.3)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(as_float32(out), expected, rtol=0, atol=TOLERANCE[dtype] * scale)

    batch.context_lens = np.full(batch.num_seqs, 1024, np.int32)
    with emulator.schedule(order):
        wrong = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
    assert np.abs(as_float32(wrong) - expected).max() > 10 * TOLERANCE[dtype] * scale
