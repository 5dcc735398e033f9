"""cuda/decode_attention.cu (flash-decoding over the paged cache) on the emulator against ReferenceOps, and
its plan.

CI runs a subset of the edge-size matrix: every head_dim and dtype once, the edge sizes (context 1, block
boundaries, uneven splits, GQA 1/4/6/8/16, block sizes 1/8/16/32, scattered block tables) on bf16 at
head_dim 64, each under two fiber orders. `python -m bench.decode_attention_matrix` runs the whole matrix.
"""

from __future__ import annotations

import contextlib
import platform

import numpy as np
import pytest

from minisarathi.backends import cuda_ops, decode_plan, emulator
from minisarathi.backends.reference import ReferenceOps
from minisarathi.batch import make_batch
from minisarathi.dtypes import DTYPES, STORAGE_DTYPES, bf16_to_float32, float32_to_bf16
from minisarathi.testing import scattered_batch

emulated_only = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)
TOLERANCE = {"float32": 2e-5, "float16": 1e-3, "bfloat16": 8e-3}  # relative to the values' scale


def on_device(x, dtype):
    return float32_to_bf16(x) if dtype == "bfloat16" else np.asarray(x, dtype=STORAGE_DTYPES[dtype])


def as_float32(x):
    return bf16_to_float32(x) if x.dtype == np.uint16 else x.astype(np.float32)


def decode_case(rng, dtype, Hq, Hk, D, block_size, runs, fused_qkv=False):
    """runs: (cached tokens, new tokens) per sequence; blocks scattered over a shuffled pool with spares.
    With fused_qkv, q is a row-strided view into a [T, (Hq + 2 Hk) D] array, as the model passes it."""
    batch, num_blocks = scattered_batch(rng, runs, block_size)
    shape = (num_blocks, Hk, block_size, D)
    k_cache, v_cache = (
        on_device(rng.standard_normal(shape), dtype),
        on_device(rng.standard_normal(shape), dtype),
    )
    width = (Hq + 2 * Hk) * D if fused_qkv else Hq * D
    q = on_device(rng.standard_normal((batch.num_tokens, width)), dtype)[:, : Hq * D].reshape(-1, Hq, D)
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
    expected = ReferenceOps().paged_attention(
        as_float32(q), as_float32(k_cache), as_float32(v_cache), batch, 0.3
    )
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
    contexts = [1, 16, 17, 130]  # one key; a block boundary and one past it; three uneven splits
    launched = check(dtype, 8, 2, head_dim, 16, contexts, order, fused_qkv=head_dim == 128)
    assert any(n.startswith("decode_attention_kernel") for n in launched)
    assert not any(n.startswith("paged_attention") for n in launched)  # every row was a decode


EDGE_CASES = {  # Hq, Hk, block_size, contexts
    "mha-bs1": (4, 4, 1, [1, 2, 31, 32, 33, 97]),
    "gqa4-bs8": (8, 2, 8, [1, 8, 9, 15, 64, 65, 200]),
    "gqa8-bs32": (16, 2, 32, [1, 32, 33, 63, 129, 300]),
    "gqa6-bs16": (12, 2, 16, [3, 16, 48, 100]),  # a group that is not a power of two
    "gqa16-bs16": (16, 1, 16, [5, 77]),  # two CTAs per KV head (group tile 8)
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
@pytest.mark.parametrize(
    "dtype, prefill_kernel",
    [("float32", "paged_attention_reduce_kernel"), ("bfloat16", "prefill_attention_kernel")],
)
def test_mixed_batch_launches_over_disjoint_rows(order, dtype, prefill_kernel):
    """Decodes (one past 512 keys) next to prefill chunks (one split into paged_attention's partitions in
    float32, on tensor cores in bf16): each kernel writes only its own rows."""
    launched = check(dtype, 8, 2, 64, 16, [1, 600, 33], order, prefills=[(520, 7), (0, 5)])
    assert any(n.startswith("decode_attention_kernel") for n in launched)
    assert any(n.startswith(prefill_kernel) for n in launched)


@emulated_only
def test_a_hybrid_steps_decodes_run_on_a_second_stream_joined_before_the_output_is_read():
    """bf16 decodes beside tensor-core prefill chunks: the decode kernels go to the side stream, the prefill's
    stay on the current one, and the output is the reference's. The emulator holds side-stream work until the
    join, so a step that forgot the join (on a GPU, a race) leaves its decode rows unwritten, and that
    shows."""
    ops, rng = cuda_ops.emulated("bfloat16"), np.random.default_rng(5)
    batch, q, k_cache, v_cache = decode_case(
        rng, "bfloat16", 8, 2, 64, 16, [(40, 1), (599, 1), (520, 7), (0, 5)]
    )
    expected = ReferenceOps().paged_attention(
        as_float32(q), as_float32(k_cache), as_float32(v_cache), batch, 0.3
    )
    streams, launcher = [], ops.launcher
    side, kernel = launcher.side_stream, launcher.kernel

    @contextlib.contextmanager
    def traced_side_stream():
        streams.append("fork")
        with side():
            yield
        streams.append("side done")

    launcher.side_stream = traced_side_stream
    launcher.kernel = lambda file, name: streams.append(name.split("<")[0]) or kernel(file, name)
    out = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
    np.testing.assert_allclose(
        as_float32(out), expected, rtol=0, atol=TOLERANCE["bfloat16"] * np.abs(expected).max()
    )
    fork, done = streams.index("fork"), streams.index("side done")
    assert {"decode_attention_kernel", "decode_attention_reduce_kernel"} == set(streams[fork + 1 : done])
    assert "prefill_attention_kernel" in streams[done + 1 :]

    launcher.join_side_stream = lambda: None  # the join forgotten, on new queries
    q = on_device(rng.standard_normal(q.shape), "bfloat16")
    expected = ReferenceOps().paged_attention(
        as_float32(q), as_float32(k_cache), as_float32(v_cache), batch, 0.3
    )
    read = as_float32(ops.paged_attention(q, k_cache, v_cache, batch, 0.3))  # what the next op would read
    emulator.join_side_stream()  # (runs the held work, so that nothing is left for later tests)
    assert np.abs(read[2:] - expected[2:]).max() <= TOLERANCE["bfloat16"] * np.abs(expected).max()
    assert not np.allclose(read[:2], expected[:2], atol=0.05)  # the two decode rows


def test_the_emulators_side_stream_holds_its_work_until_the_join():
    ran = []
    with emulator.side_stream():
        emulator.submit(lambda: ran.append("side"))
    emulator.submit(lambda: ran.append("current"))
    assert ran == ["current"]
    with pytest.raises(RuntimeError, match="never joined"):
        with emulator.side_stream():
            pass
    emulator.join_side_stream()
    assert ran == ["current", "side"]
    with pytest.raises(RuntimeError, match="no side stream"):
        emulator.join_side_stream()
    with pytest.raises(ValueError):  # a step that fails while issuing drops its side work
        with emulator.side_stream():
            emulator.submit(lambda: ran.append("dropped"))
            raise ValueError
    with pytest.raises(RuntimeError, match="no side stream"):
        emulator.join_side_stream()
    assert ran == ["current", "side"]


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
    return decode_plan.plan(
        rows * 3,
        rows,
        np.array(contexts, np.int32),
        Hq,
        Hk,
        D,
        dtype,
        2 if dtype != "float32" else 4,
        block_size,
        sms,
    )


def split_ranges(plan, context_lens):
    """(key_begin, key_end) of each work item for these lengths, as decode_attention.cu derives them."""
    _, seq, split, splits, _ = plan.items.T.astype(np.int64)
    lens = np.asarray(context_lens, np.int64)[seq]
    per_split = decode_plan.split_length(lens, splits)
    return split * per_split, np.minimum(lens, (split + 1) * per_split)


@pytest.mark.parametrize("contexts", [[4096] * 64, [512], [32768], [1, 64, 65, 130, 2047, 5000, 33]])
def test_plan_covers_each_row_once_and_sizes_partials_by_the_rows_that_split(contexts):
    plan = plan_for(contexts)
    token, seq, _, splits, slot = plan.items.T
    begin, end = split_ranges(plan, contexts)
    for r, length in enumerate(contexts):
        mine = seq == r
        assert (token[mine] == 3 * r).all() and (splits[mine] == mine.sum()).all()
        spans = sorted(zip(begin[mine], end[mine]))
        assert spans[0][0] == 0 and spans[-1][1] == length  # nothing past the row's end
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
        assert all(e > b for b, e in spans)  # no empty split
        assert (slot[mine] == -1).all() == (mine.sum() == 1)  # unsplit rows own no slot
    split = slot >= 0
    assert sorted(slot[split]) == list(range(plan.num_slots))  # each slot written once
    assert plan.num_slots == sum(plan.rows[:, 3]) and len(plan.rows) == sum(np.bincount(seq) > 1)
    assert (plan.rows[:, 1] == np.flatnonzero(np.bincount(seq) > 1)).all()


def test_plan_fills_the_gpu():
    wave = 132 * decode_plan.CTAS_PER_MULTIPROCESSOR
    big, long_one, short_one = plan_for([4096] * 64), plan_for([32768]), plan_for([512])
    for plan, lens in ((big, [4096] * 64), (long_one, [32768])):
        begin, end = split_ranges(plan, lens)
        assert len(plan.items) * 8 >= 2 * wave * 0.9  # about two waves or more
        assert (end - begin).min() >= decode_plan.MIN_SPLIT_KEYS
    assert len(long_one.items) >= 100  # one sequence, many splits
    begin, end = split_ranges(short_one, [512])
    assert (end - begin == 64).all()  # no split under 64 keys
    assert plan_for([100] * 4, Hq=32, Hk=2).group_tile == 8 and plan_for([100], Hq=8, Hk=8).group_tile == 4
    assert plan_for([100], Hq=32, Hk=2).head_chunks == 2


def test_long_splits_stage_the_block_table_a_segment_at_a_time():
    """Splits longer than SEGMENT_KEYS (few rows' worth of CTAs fill a small GPU) do not grow shared
    memory."""
    plan = plan_for([100_000] * 2, sms=1)
    begin, end = split_ranges(plan, [100_000] * 2)
    assert (end - begin).max() > 10 * decode_plan.SEGMENT_KEYS
    assert plan.table_capacity == decode_plan.SEGMENT_KEYS // 16 + 1 and plan.shared_mem < 51_000


# ---- a graph bucket's plan: splits per row fixed for the bucket, key ranges from each row's length on the
# device ----


def reference(q, k_cache, v_cache, tables, lens, scale):
    """float64 decode attention of row r's query over its first lens[r] cached keys."""
    q, k_cache, v_cache = (as_float32(x).astype(np.float64) for x in (q, k_cache, v_cache))
    Hq, Hk, block_size = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    out = np.empty_like(q)
    for r, n in enumerate(lens):
        keys = np.arange(n)
        blocks = tables[r, keys // block_size]
        k, v = k_cache[blocks, :, keys % block_size], v_cache[blocks, :, keys % block_size]  # [n, Hk, D]
        for h in range(Hq):
            scores = k[:, h // (Hq // Hk)] @ q[r, h] * scale
            p = np.exp(scores - scores.max())
            out[r, h] = p @ v[:, h // (Hq // Hk)] / p.sum()
    return out


def bucket_case(dtype, contexts, capacity, block_size=16, seed=0, cached=None):
    """A decode batch whose block tables are widened to `capacity` keys (zeros past each row's blocks) and
    whose attention is planned for rows of up to `capacity` keys, as decode_graphs.pad_to_bucket makes it.
    cached: keys each row's blocks hold (default: its context), so that its length can grow in place."""
    rng = np.random.default_rng(seed)
    cached = contexts if cached is None else cached
    batch, q, k_cache, v_cache = decode_case(rng, dtype, 8, 2, 64, block_size, [(c - 1, 1) for c in cached])
    tables = np.zeros((len(contexts), capacity // block_size), np.int32)
    tables[:, : batch.block_tables.shape[1]] = batch.block_tables
    batch.block_tables, batch.plan_context_len = tables, capacity
    batch.context_lens = np.array(contexts, np.int32)
    return batch, q, k_cache, v_cache


def assert_close(out, expected, dtype):
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(as_float32(out), expected, rtol=0, atol=TOLERANCE[dtype] * scale)


def op_plan(ops, batch, q, k_cache):
    """The plan CudaOps._decode_plan makes for this batch: what ops.paged_attention launches."""
    Hq, Hk, D, block_size = q.shape[1], k_cache.shape[1], q.shape[2], k_cache.shape[2]
    return ops._decode_plan(
        batch, np.ones(batch.num_seqs, bool), Hq, Hk, D, q.dtype.itemsize, block_size, np.int32(0)
    )[0]


@pytest.mark.parametrize("rows", [1, 64])
def test_bucket_grid_does_not_grow_with_max_model_len(rows):
    """Rows of 4k keys under buckets planned for 16k and for 128k keys: the same grid, at most two waves, and
    as many CTAs with keys as the step's own plan gives (up to about two waves). Before, the splits were cut
    for max_model_len: at 128k, batch 1 had 32 CTAs with keys of 1,024 and batch 64 launched 32,768."""
    ops = cuda_ops.emulated("bfloat16")
    wave = ops.launcher.multiprocessors * decode_plan.CTAS_PER_MULTIPROCESSOR
    grids = set()
    for capacity in (16384, 131072):
        batch = make_batch(
            [0] * rows,
            [4095] * rows,
            [1] * rows,
            np.zeros((rows, capacity // 16), np.int32),
            [True] * rows,
            16,
        )
        batch.plan_context_len = capacity
        plan = ops._decode_plan(batch, np.ones(rows, bool), 32, 8, 128, 2, 16, np.int32(0))[0]
        grids.add(len(plan.items))
        assert len(plan.items) * 8 <= 2 * wave
        begin, end = split_ranges(plan, batch.context_lens)
        assert (end > begin).sum() * 8 >= min(len(plan_for([4096] * rows).items) * 8, 0.9 * 2 * wave)
    assert len(grids) == 1


@emulated_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bucket_rows_of_very_different_lengths(order, dtype):
    """One bucket (75 splits per row here): padding rows (1 key), a row of one 64-key split, rows ending at a
    split boundary and one past it, a long row of 96-key splits ending on one, and one past it; most splits
    lie past their row's end and exit, rows with one used split write the output themselves, the reduce merges
    the rest. Negative control: the same launch told every row is 1024 keys long reads the zero table
    entries."""
    contexts = [1, 1, 64, 128, 129, 5760, 5761]
    batch, q, k_cache, v_cache = bucket_case(dtype, contexts, 8192)
    ops = cuda_ops.emulated(dtype)
    plan = op_plan(ops, batch, q, k_cache)
    assert (plan.items[:, 3] == 1056 // (len(contexts) * 2)).all()
    begin, end = split_ranges(plan, contexts)
    used = np.bincount(plan.items[:, 1], weights=end > begin)
    assert used.tolist() == [1, 1, 1, 2, 3, 60, 61]
    with emulator.schedule(order):
        out = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
    expected = reference(q, k_cache, v_cache, batch.block_tables, contexts, 0.3)
    assert_close(out, expected, dtype)

    batch.context_lens = np.full(batch.num_seqs, 1024, np.int32)
    with emulator.schedule(order):
        wrong = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
    assert np.abs(as_float32(wrong) - expected).max() > 10 * TOLERANCE[dtype] * max(
        1.0, np.abs(expected).max()
    )


@emulated_only
@pytest.mark.parametrize("bucket", [False, True])
def test_splits_longer_than_a_segment(bucket):
    """On a one-SM device a few splits fill the GPU, some over 2048 keys long: each CTA stages its block-table
    entries a segment at a time, eagerly (2 and 3 splits) and in a bucket (2 per row; the 1-key row uses
    one)."""
    contexts = [4500, 1] if bucket else [4500, 5000]
    batch, q, k_cache, v_cache = bucket_case("bfloat16", contexts, 8192 if bucket else 5008, seed=3)
    if not bucket:
        batch.plan_context_len = None
    ops = cuda_ops.emulated("bfloat16")
    ops.launcher.multiprocessors = 1
    begin, end = split_ranges(op_plan(ops, batch, q, k_cache), contexts)
    assert (end - begin).max() > decode_plan.SEGMENT_KEYS and (end > begin).sum() == (3 if bucket else 5)
    out = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
    assert_close(out, reference(q, k_cache, v_cache, batch.block_tables, contexts, 0.3), "bfloat16")


@emulated_only
def test_a_captured_bucket_replays_with_each_steps_lengths():
    """A bucket's decode attention captured once (emulator graph) and replayed after its context lengths
    change on the device: rows grow past split boundaries and a padding row becomes a real one; every replay
    matches the float64 reference for the current lengths."""
    steps = [[1, 40, 64, 300], [2, 64, 65, 700], [129, 1, 1000, 1]]
    longest = np.max(steps, axis=0).tolist()
    batch, q, k_cache, v_cache = bucket_case("bfloat16", steps[0], 131072, cached=longest)
    ops = cuda_ops.emulated("bfloat16")
    ops.paged_attention(q, k_cache, v_cache, batch, 0.3)  # the first step runs eagerly: uploads and plan
    graph, out = ops.launcher.capture(lambda: ops.paged_attention(q, k_cache, v_cache, batch, 0.3))
    device_lens = ops._metadata(batch.context_lens)  # the array the captured kernels read
    for lens in steps:
        device_lens[...] = lens
        graph.launch()
        assert_close(out, reference(q, k_cache, v_cache, batch.block_tables, lens, 0.3), "bfloat16")
