"""The kernels of cuda/*.cu on the CPU emulator against ReferenceOps (float32) or float64.

Every kernel runs under two fiber orders (forward, reverse) so a missing barrier shows up, on small odd
shapes, in float32, float16 and bfloat16 (inputs rounded to the type, reference computed from them).
"""

from __future__ import annotations

import concurrent.futures
import platform
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends import cuda_ops, emulator
from minisarathi.backends.reference import ReferenceOps
from minisarathi.config import rope_cos_sin_table
from minisarathi.dtypes import DTYPES, STORAGE_DTYPES, bf16_to_float32, float32_to_bf16
from minisarathi.paths import cuda_dir
from minisarathi.testing import scattered_batch

CHECKS = Path(__file__).parents[1] / "kernels" / "emulator_checks.cu"
CHECK_KERNELS = [
    "racy_broadcast",
    "synced_broadcast",
    "read_uninitialized",
    "early_exit_barrier",
    "scaled_warp_sum",
    "round_trip_16bit",
    "flush_to_zero",
]
pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)
TOLERANCE = {"float32": 2e-5, "float16": 1e-3, "bfloat16": 8e-3}  # relative to the values' scale


@pytest.fixture(scope="module", autouse=True)
def built():
    # Cold builds take seconds per file: build them all at once on the available cores.
    jobs = [(cuda_dir() / f, cuda_ops.name_expressions(f), ()) for f in cuda_ops.kernel_files()]
    jobs.append((CHECKS, CHECK_KERNELS, (cuda_dir(),)))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda job: emulator.load_module(*job), jobs))


@pytest.fixture(params=["forward", "reverse"])
def order(request):
    with emulator.schedule(request.param, seed=1):
        yield request.param


def on_device(x: np.ndarray, dtype: str) -> np.ndarray:
    return float32_to_bf16(x) if dtype == "bfloat16" else np.asarray(x, dtype=STORAGE_DTYPES[dtype])


def as_float32(x: np.ndarray) -> np.ndarray:
    return bf16_to_float32(x) if x.dtype == np.uint16 else x.astype(np.float32)


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype: str):
    actual, expected = as_float32(actual), np.asarray(expected, dtype=np.float32)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE[dtype] * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [45, 64])  # odd rows take 1 element per access, 64 takes 16 bytes
def test_embedding(order, dtype, hidden):
    ops, rng = cuda_ops.emulated(dtype), np.random.default_rng(0)
    table = on_device(rng.standard_normal((37, hidden)), dtype)
    ids = np.array([0, 36, 5, 5, 17], dtype=np.int32)
    np.testing.assert_array_equal(ops.embedding(table, ids), table[ids])
    with pytest.raises(ValueError, match="ids"):
        ops.embedding(table, np.array([37], dtype=np.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [77, 1000])
def test_rms_norm_and_fused_residual_add(order, dtype, hidden):
    ops, rng = cuda_ops.emulated(dtype), np.random.default_rng(1)
    x, residual = (
        on_device(rng.standard_normal((5, hidden)) * 3, dtype),
        on_device(rng.standard_normal((5, hidden)), dtype),
    )
    w = on_device(rng.standard_normal(hidden), dtype)
    assert_close(ops.rms_norm(x, w, 1e-5), ReferenceOps().rms_norm(as_float32(x), as_float32(w), 1e-5), dtype)

    expected_residual = as_float32(residual) + as_float32(x)
    expected = ReferenceOps().rms_norm(as_float32(on_device(expected_residual, dtype)), as_float32(w), 1e-5)
    out, new_residual = ops.add_rms_norm(x, residual, w, 1e-5)
    assert new_residual is residual  # updated in place
    assert_close(residual, expected_residual, dtype)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_of_a_row_strided_view(order, dtype):
    """Qwen3's q/k norm: rms_norm over each head of q = qkv[:, :Hq D] viewed [T, Hq, D], read in place."""
    ops, rng = cuda_ops.emulated(dtype), np.random.default_rng(5)
    T, Hq, Hk, D = 3, 4, 2, 32
    qkv = on_device(rng.standard_normal((T, (Hq + 2 * Hk) * D)) * 3, dtype)
    w = on_device(rng.standard_normal(D), dtype)
    q = qkv[:, D : (Hq + 1) * D].reshape(T, Hq, D)  # a view that starts one head in: no copy, row-strided
    assert not q.flags.c_contiguous and np.shares_memory(q, qkv)
    x = as_float32(q).astype(np.float64)
    expected = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * as_float32(w)  # float64[T, Hq, D]
    out = ops.rms_norm(q, w, 1e-5)
    assert out.shape == (T, Hq, D)
    assert_close(out, expected.astype(np.float32), dtype)
    assert not np.allclose(as_float32(out), x, atol=0.1)  # it normalized (the input has rms 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_kernels_fall_back_on_unaligned_rows(order, dtype):
    """A row that starts off a 16-byte boundary takes the one-element path, with the same results."""
    ops, rng = cuda_ops.emulated(dtype), np.random.default_rng(13)
    buffer = on_device(rng.standard_normal(1 + 3 * 128), dtype)
    x = buffer[1:].reshape(3, 128)  # contiguous, but 2 or 4 bytes past alignment
    assert x.ctypes.data % 16
    w = on_device(rng.standard_normal(128), dtype)
    assert_close(ops.rms_norm(x, w, 1e-5), ReferenceOps().rms_norm(as_float32(x), as_float32(w), 1e-5), dtype)
    assert_close(ops.silu_and_mul(x), ReferenceOps().silu_and_mul(as_float32(x)), dtype)
    np.testing.assert_array_equal(ops.embedding(x, np.array([2, 0], np.int32)), x[[2, 0]])


def test_weights_and_caches_must_be_16_byte_aligned():
    ops = cuda_ops.emulated()
    with pytest.raises(ValueError, match="16-byte aligned"):
        cuda_ops._aligned(np.zeros(9, np.float32)[1:], "weight")
    assert ops.zeros((3, 5)).ctypes.data % 16 == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 2, 16), (3, 1, 10)], ids=["D16-vector", "D10-scalar"])
def test_rope_store_kv_rotates_q_and_stores_rotated_k_and_v(order, dtype, shape):
    ops, rng = cuda_ops.emulated(dtype), np.random.default_rng(14)
    Hq, Hk, D = shape
    T, block_size, num_blocks = 6, 4, 5
    qkv = on_device(rng.standard_normal((T, (Hq + 2 * Hk) * D)), dtype)
    before = qkv.copy()

    def split(a):
        return (
            a[:, : Hq * D].reshape(T, Hq, D),
            a[:, Hq * D : (Hq + Hk) * D].reshape(T, Hk, D),
            a[:, (Hq + Hk) * D :].reshape(T, Hk, D),
        )

    positions = np.array([0, 1, 2, 511, 4097, 70000], dtype=np.int32)
    slots = np.array([19, 0, -1, 7, 3, 12], dtype=np.int32)  # scattered, one padding token
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32)  # the model's frequencies
    cos_sin = rope_cos_sin_table(inv_freq, 70001)
    k_cache, v_cache = ops.zeros((num_blocks, Hk, block_size, D)), ops.zeros((num_blocks, Hk, block_size, D))
    ops.rope_store_kv(*split(qkv), k_cache, v_cache, positions, slots, ops.constant(cos_sin))

    reference = as_float32(before)
    ref_k_cache, ref_v_cache = np.zeros(k_cache.shape, np.float32), np.zeros(v_cache.shape, np.float32)
    ReferenceOps().rope_store_kv(*split(reference), ref_k_cache, ref_v_cache, positions, slots, cos_sin)
    assert_close(qkv[:, : Hq * D], as_float32(on_device(reference[:, : Hq * D], dtype)), dtype)
    np.testing.assert_array_equal(qkv[:, Hq * D :], before[:, Hq * D :])  # k and v are read only
    assert_close(k_cache, as_float32(on_device(ref_k_cache, dtype)), dtype)
    np.testing.assert_array_equal(as_float32(v_cache), ref_v_cache)  # values are copied bit for bit

    # Independent float64 truth at far positions: the table's float64 angles keep them exact to float32.
    half = D // 2
    angles = positions[:, None].astype(np.float64) * inv_freq.astype(np.float64)
    x = as_float32(before)[:, : Hq * D].reshape(T, Hq, D).astype(np.float64)
    c, s_ = np.cos(angles)[:, None], np.sin(angles)[:, None]
    truth = np.concatenate(
        [x[..., :half] * c - x[..., half:] * s_, x[..., half:] * c + x[..., :half] * s_], axis=2
    )
    assert_close(qkv[:, : Hq * D].reshape(T, Hq, D), truth, dtype)
    with pytest.raises(ValueError, match="positions"):
        ops.rope_store_kv(
            *split(qkv), k_cache, v_cache, np.full(T, 70001, np.int32), slots, ops.constant(cos_sin)
        )


def attention_case(rng, dtype, Hq, Hk, D, block_size, runs):
    """runs: (already cached tokens, new tokens) per sequence; blocks scattered over a shuffled pool."""
    batch, num_blocks = scattered_batch(rng, runs, block_size)
    shape = (num_blocks, Hk, block_size, D)
    k_cache, v_cache = (
        on_device(rng.standard_normal(shape), dtype),
        on_device(rng.standard_normal(shape), dtype),
    )
    q = on_device(rng.standard_normal((batch.num_tokens, Hq, D)), dtype)
    return batch, q, k_cache, v_cache


ATTENTION_SHAPES = [  # Hq, Hk, D, block_size
    (4, 4, 8, 1),  # MHA, one token per block
    (8, 2, 16, 4),  # GQA 4
    (6, 3, 12, 5),  # GQA 2, odd block size
    (16, 1, 8, 16),  # 16 query heads on one KV head (MQA)
]
MIXED_RUNS = [(0, 1), (0, 7), (3, 1), (4, 1), (5, 1), (15, 2), (16, 1), (9, 9), (0, 17)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "Hq{}-Hk{}-D{}-bs{}".format(*s))
def test_paged_attention_mixed_batch(order, dtype, shape):
    """Prefills from 0, chunks continuing a history, decodes at context 1 and at block boundaries, in one
    batch."""
    ops, rng = cuda_ops.emulated(dtype), np.random.default_rng(4)
    batch, q, k_cache, v_cache = attention_case(rng, dtype, *shape, MIXED_RUNS)
    out = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
    expected = ReferenceOps().paged_attention(
        as_float32(q), as_float32(k_cache), as_float32(v_cache), batch, 0.3
    )
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_attention_long_contexts_split_into_partitions(order, dtype):
    ops, rng = cuda_ops.emulated(dtype), np.random.default_rng(5)
    runs = [(1100, 1), (511, 1), (512, 1), (1020, 5)]  # 3, 1, 2 and 3 partitions of 512 keys
    batch, q, k_cache, v_cache = attention_case(rng, dtype, 4, 2, 8, 16, runs)
    assert batch.max_context_len > cuda_ops.PA_PARTITION_SIZE
    out = ops.paged_attention(q, k_cache, v_cache, batch, 0.5)
    expected = ReferenceOps().paged_attention(
        as_float32(q), as_float32(k_cache), as_float32(v_cache), batch, 0.5
    )
    assert_close(out, expected, dtype)


def test_paged_attention_float64_reference_with_strided_query():
    """Independent of ReferenceOps: a direct float64 loop over positions, q a view into a QKV row."""
    ops, rng = cuda_ops.emulated("float32"), np.random.default_rng(6)
    Hq, Hk, D, bs = 4, 2, 8, 3
    batch, _, k_cache, v_cache = attention_case(rng, "float32", Hq, Hk, D, bs, [(2, 3), (6, 1)])
    qkv = rng.standard_normal((batch.num_tokens, (Hq + 2 * Hk) * D)).astype(np.float32)
    q = qkv[:, : Hq * D].reshape(-1, Hq, D)
    out = ops.paged_attention(q, k_cache, v_cache, batch, 0.35)
    for s in range(batch.num_seqs):
        for t in range(batch.query_start[s], batch.query_start[s + 1]):
            keys = np.arange(batch.positions[t] + 1)
            slots = batch.block_tables[s, keys // bs] * bs + keys % bs
            for h in range(Hq):
                kv_head = h // (Hq // Hk)
                k = k_cache[slots // bs, kv_head, slots % bs].astype(np.float64)
                v = v_cache[slots // bs, kv_head, slots % bs].astype(np.float64)
                scores = k @ q[t, h].astype(np.float64) * 0.35
                p = np.exp(scores - scores.max())
                np.testing.assert_allclose(out[t, h], p @ v / p.sum(), atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [74, 128])  # 37 columns: one element per access; 64: 16 bytes
def test_silu_and_mul(order, dtype, width):
    ops, rng = cuda_ops.emulated(dtype), np.random.default_rng(7)
    x = on_device(rng.standard_normal((3, width)) * 6, dtype)
    assert_close(ops.silu_and_mul(x), ReferenceOps().silu_and_mul(as_float32(x)), dtype)


def test_linear_with_bias_in_bfloat16():
    ops, rng = cuda_ops.emulated("bfloat16"), np.random.default_rng(8)
    x, w, b = (ops.weight(rng.standard_normal(s)) for s in [(3, 20), (9, 20), (9,)])
    expected = as_float32(x) @ as_float32(w).T + as_float32(b)
    assert_close(ops.linear(x, w, b), expected, "bfloat16")


# ---- sampling kernels --------------------------------------------------------------------------------


def test_greedy_argmax_breaks_ties_to_lowest_index(order):
    ops, rng = cuda_ops.emulated(), np.random.default_rng(9)
    logits = rng.standard_normal((4, 1000)).astype(np.float32)
    logits[1, [10, 700]] = 50.0
    logits[2, :] = 0.0
    np.testing.assert_array_equal(ops.greedy(logits), np.argmax(logits, axis=1))


def reference_sample(logits, temperature, top_k, top_p, min_p, u) -> int:
    """float64 reference of sample_kernel's rule: min-p, top-k, top-p on weights exp(x/t - max), then an
    inverse CDF in index order."""
    if temperature <= 0:
        return int(np.argmax(logits))
    w = np.exp((logits.astype(np.float64) - logits.max()) / temperature)
    keep = (w >= min_p) & (w > 0)
    if 0 < top_k < len(w):
        keep &= w >= np.sort(w)[::-1][top_k - 1]
    if top_p < 1:
        order = np.argsort(-w, kind="stable")
        mass = np.cumsum(w[order] * keep[order])
        cutoff = w[order][np.searchsorted(mass, top_p * mass[-1])]
        keep &= w >= cutoff
    cdf = np.cumsum(np.where(keep, w, 0))
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


@pytest.mark.parametrize("V", [301, 5003])
def test_sample_kernel_matches_float64_reference(order, V):
    ops, rng = cuda_ops.emulated(), np.random.default_rng(10)
    params = [  # temperature, top_k, top_p, min_p
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.2),
        (0.9, 20, 0.5, 0.05),
        (1.0, 1, 1.0, 0.0),
        (2.0, 400, 0.99, 0.0),
        (1.0, 50, 0.6, 0.3),  # min-p removes tokens inside the top-k set: top-p sees the smaller mass
        (0.8, 50, 0.9, 0.0),
        (1.0, 3, 1.0, 0.0),
    ]
    logits = (rng.standard_normal((len(params), V)) * 2).astype(np.float32)
    logits[-1, :7] = logits[-1].max()  # 7 tokens tie for the top: top-k 3 keeps all of them
    for trial in range(3):
        u = rng.uniform(size=len(params))
        columns = list(zip(*params))
        ids = ops.sample(logits, *columns, u)
        expected = [reference_sample(logits[r], *params[r], float(u[r])) for r in range(len(params))]
        np.testing.assert_array_equal(ids, expected)


def test_apply_penalties(order):
    ops, rng = cuda_ops.emulated(), np.random.default_rng(11)
    logits = rng.standard_normal((2, 50)).astype(np.float32)
    expected = logits.copy()
    tokens = [np.array([3, 7, 49]), np.array([0])]
    counts = [np.array([0, 2, 1]), np.array([4])]
    rep, freq, pres = np.array([1.5, 1.0]), np.array([0.1, 0.5]), np.array([0.3, 0.0])
    for r in range(2):
        for t, c in zip(tokens[r], counts[r]):
            x = expected[r, t]
            x = x / rep[r] if x > 0 else x * rep[r]
            expected[r, t] = x - freq[r] * c - pres[r] * (c > 0)
    ops.apply_penalties(logits, tokens, counts, rep, freq, pres)
    np.testing.assert_allclose(logits, expected, atol=1e-6)


# ---- the emulator itself -------------------------------------------------------------------------------


def check_kernel(name):
    return emulator.load_module(CHECKS, CHECK_KERNELS, (cuda_dir(),)).get_function(name)


def test_missing_barrier_is_caught_by_reverse_order():
    x = np.array([42.0], dtype=np.float32)
    results = {}
    for order in ("forward", "reverse"):
        with emulator.schedule(order):
            out = np.zeros(64, dtype=np.float32)
            check_kernel("racy_broadcast")((1,), (64,), (x, out))
            results[order] = out
    assert np.all(results["forward"] == 42.0)  # looks right when thread 0 happens to run first
    assert np.isnan(results["reverse"][1:]).all()  # the others read shared memory nobody wrote yet
    for order in ("forward", "reverse", "random"):
        with emulator.schedule(order, seed=5):
            out = np.zeros(64, dtype=np.float32)
            check_kernel("synced_broadcast")((2,), (64,), (x, out))
            assert np.all(out == 42.0)


def test_shared_memory_is_nan_at_block_start():
    out = np.zeros(128, dtype=np.float32)
    check_kernel("read_uninitialized")((3,), (64,), (out,), shared_mem=256)
    assert np.isnan(out).all()


def test_thread_exiting_before_a_barrier_is_a_clear_error():
    with pytest.raises(RuntimeError, match="exited while 16 threads wait at __syncthreads"):
        check_kernel("early_exit_barrier")((1,), (32,), (np.zeros(32, np.float32),))


def test_launch_checks_exact_parameter_types_and_limits():
    kernel = check_kernel("scaled_warp_sum")
    x, out = np.arange(64, dtype=np.float32), np.zeros(2, np.float32)
    kernel((2,), (32,), (x, out, np.float32(0.5)))
    np.testing.assert_allclose(out, [x[:32].sum() / 2, x[32:].sum() / 2])
    with pytest.raises(TypeError, match="numpy.float32"):
        kernel((2,), (32,), (x, out, 0.5))  # CuPy would pass a Python float as a double
    with pytest.raises(TypeError, match="float32"):
        kernel((2,), (32,), (x.astype(np.float64), out, np.float32(1)))
    with pytest.raises(TypeError, match="takes 3 arguments"):
        kernel((2,), (32,), (x, out))
    with pytest.raises(
        emulator.CUDADriverError, match="65536 bytes of dynamic shared memory"
    ):  # as CuPy raises
        kernel((1,), (32,), (x, out, np.float32(1)), shared_mem=64 * 1024)
    with pytest.raises(RuntimeError, match="does not exist"):
        kernel((1,), (48,), (x, out, np.float32(1)))  # warp shuffles with a partial warp


def test_16bit_conversions_round_to_nearest_even():
    rng = np.random.default_rng(12)
    specials = [
        0.0,
        -0.0,
        1.0,
        65504.0,
        65519.0,
        65520.0,
        1e6,
        -1e6,
        6.1e-5,
        5.96e-8,
        2.98e-8,
        1e-9,
        1.0 + 2.0**-11,
        1.0 + 3 * 2.0**-11,
        1.0 + 2.0**-8,
        1.0 + 3 * 2.0**-8,
        np.inf,
        -np.inf,
        np.nan,
    ]
    x = np.concatenate([specials, rng.standard_normal(500) * 10.0 ** rng.integers(-8, 6, 500)]).astype(
        np.float32
    )
    half, bf16 = np.empty_like(x), np.empty_like(x)
    check_kernel("round_trip_16bit")((-(-len(x) // 64),), (64,), (x, half, bf16, np.int32(len(x))))
    with np.errstate(over="ignore"):  # 1e6 -> inf in float16, as intended
        np.testing.assert_array_equal(half, x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(bf16, bf16_to_float32(float32_to_bf16(x)))
    ties = bf16[[specials.index(1.0 + 2.0**-8), specials.index(1.0 + 3 * 2.0**-8)]]
    np.testing.assert_array_equal(ties, [1.0, 1.0 + 2.0**-6])  # halfway cases go to the even neighbour


def test_float32_denormals_flush_to_zero_as_under_ftz():
    denormal = np.float32(1e-39)
    assert 0 < denormal < np.finfo(np.float32).tiny
    x = np.array([1e-30, 1e-10, denormal, 1.0], dtype=np.float32)
    out = np.full(4, np.nan, np.float32)
    check_kernel("flush_to_zero")((1,), (32,), (x, out))
    assert out[:3].tolist() == [0.0, 0.0, 0.0]
    assert out[3] == denormal
    # The host's own arithmetic is untouched: the flags live in the fibers only.
    assert x[0] * x[1] > 0
