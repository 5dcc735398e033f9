"""The native decode attention (minisarathi/backends/cpu/native_attention.py) against float64 NumPy on every
path this CPU runs, its exp bit for bit against a NumPy emulation, its batch invariance, CpuOps' rule for it,
and the fallback to NumPy's attention where it cannot run."""

import logging

import numpy as np
import pytest

from minisarathi.backends.cpu import native_attention
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.testing import ScheduledChunk, build_batch, fma32

needs_kernel = pytest.mark.skipif(
    native_attention.kernel() is None, reason="no AVX2 + FMA CPU or no C++ compiler here"
)
ORDER = ["avx2", "avx512"]


def forced(isa: str) -> native_attention.CpuAttention:
    """The kernel's path isa; skips where this CPU lacks it."""
    native = native_attention.kernel()
    if native is None or ORDER.index(isa) > ORDER.index(native.isa):
        pytest.skip(f"this CPU has no {isa} path")
    return native_attention.CpuAttention(native.lib, isa)


@pytest.fixture(params=ORDER)
def path(request, monkeypatch):
    """CpuOps' decodes on the kernel's path request.param (forced, as each machine picks its widest)."""
    attention = forced(request.param)
    monkeypatch.setattr(native_attention, "kernel", lambda: attention)
    return attention


@needs_kernel
def test_every_model_runs_it_where_it_builds():
    """The kernel beat NumPy's kept decode K/V at every shape measured (bench/cpu_decode_attention.py), and
    reading the cache in place it needs none of that copy's memory: decodes use it wherever it runs."""
    assert native_attention.runs()


def case(seed, runs, Hq, Hk, D, block_size, spare_blocks=3):
    """A batch of (history, new tokens) runs over blocks scattered in a pool whose every slot holds random
    numbers (the slots no run owns, and the ones past each context, must not change a result), and its
    queries."""
    rng = np.random.default_rng(seed)
    needs = [-(-(h + n) // block_size) for h, n in runs]
    pool = rng.permutation(sum(needs) + spare_blocks).tolist()
    tables = [[pool.pop() for _ in range(need)] for need in needs]
    batch = build_batch([ScheduledChunk([0] * n, h, t, True) for (h, n), t in zip(runs, tables)], block_size)
    shape = (sum(needs) + spare_blocks, Hk, block_size, D)
    k_cache, v_cache = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    q = (3 * rng.standard_normal((batch.num_tokens, Hq, D))).astype(np.float32)  # scores spread wide
    return batch, q, k_cache, v_cache


def reference(q, k_cache, v_cache, batch, scale):
    """float64[T, Hq, D]: causal attention of every query row to its sequence's keys, dense, in float64 (the
    query scaled in float32 first, as both backends do)."""
    T, Hq, D = q.shape
    _, Hk, block_size, _ = k_cache.shape
    out = np.empty((T, Hq, D))
    for s in range(batch.num_seqs):
        start, end, n = int(batch.query_start[s]), int(batch.query_start[s + 1]), int(batch.context_lens[s])
        blocks = batch.block_tables[s, : -(-n // block_size)]
        k, v = (
            (cache[blocks].transpose(1, 0, 2, 3).reshape(Hk, -1, D)[:, :n]).astype(np.float64)
            for cache in (k_cache, v_cache)
        )  # [Hk, n, D]
        for row in range(start, end):
            visible = n - (end - 1 - row)
            qs = (q[row] * np.float32(scale)).astype(np.float64).reshape(Hk, Hq // Hk, D)
            scores = qs @ k[:, :visible].swapaxes(-1, -2)  # [Hk, G, visible]
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            out[row] = (weights @ v[:, :visible]).reshape(Hq, D)
    return out


def check_close(got, ref):
    """float32 attention against float64: within a few float32 roundings of the largest value of V."""
    assert got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * max(1.0, np.abs(ref).max()) * 4)


EXP_INPUTS = np.concatenate(
    [
        -np.logspace(-8, np.log10(110), 100_000),
        np.linspace(-110, 0, 200_001),
        [0.0, -0.0, -87.3, -103.9, -104, -200, -np.inf, -1e-45],
    ]
).astype(np.float32)  # all the softmax feeds the exp (scores minus their max: x <= 0), into the subnormals


def emulated_exp(x: np.ndarray, fused=fma32) -> np.ndarray:
    """float32 e^x, x <= 0, by the kernel's steps (native_attention.cpp's exp_nonpositive); fused: its fused
    multiply-add."""
    f = np.float32
    x = np.maximum(f(-104.0), x)
    n = np.rint(x * f(1.44269504088896341))
    r = fused(-n, f(0.693359375), x)
    r = fused(-n, f(-2.12194440e-4), r)
    p = np.full_like(x, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = fused(p, r, f(c))
    p = fused(p, r * r, r) + f(1)
    with np.errstate(invalid="ignore"):
        return (p.astype(np.float64) * np.exp2(n.astype(np.float64))).astype(np.float32)  # one rounding


@pytest.mark.parametrize("isa", ORDER)
def test_exp_within_one_ulp_of_float64_and_the_same_bits_on_every_path(isa):
    """The kernel's polynomial exp, into the subnormals and to 0, NaN staying NaN; each path gives the bits
    of the emulation of its steps, so the paths agree bit for bit."""
    kernel = forced(isa)
    got = kernel.exp(EXP_INPUTS)
    ref = np.exp(EXP_INPUTS.astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got.astype(np.float64) - ref) <= ulp)
    np.testing.assert_array_equal(got, emulated_exp(EXP_INPUTS))
    assert np.isnan(kernel.exp(np.array([np.nan, -1], np.float32))[0])


@needs_kernel
def test_the_exp_emulation_tells_an_unfused_polynomial_apart():
    """Negative control: the same steps with a rounding after each multiply give other bits somewhere, so
    the exact comparison above can fail."""
    unfused = emulated_exp(EXP_INPUTS, fused=lambda a, b, c: a * b + c)
    assert not np.array_equal(native_attention.kernel().exp(EXP_INPUTS), unfused)


@needs_kernel
def test_a_path_runs_only_where_the_cpu_has_it():
    native = native_attention.kernel()
    if native.isa != "avx512":
        with pytest.raises(ValueError, match="cannot run the avx512 path"):
            native_attention.CpuAttention(native.lib, "avx512")


DECODES_FIRST = [(9, 1), (30, 1), (0, 1), (17, 1), (3, 1), (12, 6), (0, 9)]
DECODES_BETWEEN = [(12, 6), (9, 1), (30, 1), (0, 9), (17, 1), (3, 1), (15, 1)]
# many blocks per context, ragged: 1 key up to 1200 keys (Llama's head_dim 128 and G 4 among the shapes)
LONG_RAGGED = [(1199, 1), (0, 1), (517, 1), (16, 1), (63, 1), (40, 24), (300, 1)]


# speculation's verification chunks: runs of up to NATIVE_RUN_TOKENS, a decode per query on the kernel
SHORT_RUNS = [(9, 1), (30, 5), (0, 8), (17, 2), (3, 9), (40, 1)]


@pytest.mark.parametrize("runs", [DECODES_FIRST, DECODES_BETWEEN, LONG_RAGGED, SHORT_RUNS])
@pytest.mark.parametrize(
    "Hq, Hk, D, block_size",
    [
        (8, 4, 8, 16),
        (8, 4, 32, 16),
        (8, 4, 64, 16),
        (32, 8, 128, 16),
        (6, 2, 10, 3),
        (3, 3, 6, 5),
        (4, 1, 8, 1),
        (4, 4, 17, 7),
        (6, 2, 200, 32),
        (2, 1, 1, 2),
        (16, 2, 16, 4),
        (7, 1, 64, 16),
        (10, 2, 40, 16),
        (12, 2, 96, 8),
    ],
)
def test_matches_float64(path, runs, Hq, Hk, D, block_size):
    """CpuOps.paged_attention as the engine calls it (decodes on the kernel, prefill chunks on NumPy)."""
    batch, q, k_cache, v_cache = case(Hq * 1000 + D * 10 + block_size, runs, Hq, Hk, D, block_size)
    out = CpuOps().paged_attention(q, k_cache, v_cache, batch, D**-0.5)
    assert out.shape == q.shape
    check_close(out, reference(q, k_cache, v_cache, batch, D**-0.5))


@pytest.mark.parametrize("Hq, Hk, D", [(32, 4, 64), (16, 2, 40)])  # work past MIN_PARALLEL_WORK
def test_the_same_bits_on_any_thread_count_and_a_dropped_key_shows(path, Hq, Hk, D):
    """Threads take (decode, KV head) items: the output is the same bits on 1, 2 and 3 threads, every row
    written (out starts as NaN), and within float32 roundings of float64. Negative control: the reference
    with one key fewer for one decode (a block's or a segment's edge key dropped) is outside the tolerance."""
    batch, q, k_cache, v_cache = case(21, LONG_RAGGED, Hq, Hk, D, 16)
    decodes = np.flatnonzero(np.diff(batch.query_start) == 1)
    rows = native_attention.DecodeRows(batch, decodes, k_cache.shape, Hq)
    addresses = (k_cache.ctypes.data, v_cache.ctypes.data)
    outs = []
    for threads in (1, 2, 3):
        out = np.full(q.shape, np.nan, np.float32)
        path.decode(q, addresses, rows, 0.3, out, threads=threads)
        outs.append(out[batch.query_start[decodes]])
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])
    ref = reference(q, k_cache, v_cache, batch, 0.3)[batch.query_start[decodes]]
    check_close(outs[0], ref)
    for s in (3, 4):  # (16, 1): its last key opens a block; (63, 1): its last key ends a 32-key segment
        batch.context_lens[s] -= 1
        wrong = reference(q, k_cache, v_cache, batch, 0.3)[batch.query_start[decodes]]
        batch.context_lens[s] += 1
        with pytest.raises(AssertionError):
            check_close(outs[0], wrong)


@needs_kernel
def test_strided_query_rows():
    """The model hands q as a view of its fused qkv rows (row stride (Hq + 2 Hk) D): read in place."""
    Hq, Hk, D = 8, 4, 8
    batch, q, k_cache, v_cache = case(5, DECODES_BETWEEN, Hq, Hk, D, 16)
    qkv = np.concatenate([q, np.full((len(q), 2 * Hk, D), np.nan, np.float32)], axis=1)
    out = CpuOps().paged_attention(qkv[:, :Hq], k_cache, v_cache, batch, 0.35)
    np.testing.assert_array_equal(out, CpuOps().paged_attention(q, k_cache, v_cache, batch, 0.35))
    check_close(out, reference(q, k_cache, v_cache, batch, 0.35))


@pytest.mark.parametrize(
    "Hq, Hk, D, block_size", [(8, 4, 8, 16), (8, 4, 64, 16), (12, 3, 24, 5), (4, 2, 4, 3)]
)
def test_a_decode_is_bit_identical_whatever_its_batch(path, Hq, Hk, D, block_size):
    """Greedy output must not depend on the batch mix: a decode's row is the same alone, among other decodes
    in any number and order, and beside prefill chunks."""
    runs = [(h, 1) for h in (0, 5, 16, 33, 100, 250, 7, 64)] + [(20, 7)]
    batch, q, k_cache, v_cache = case(11, runs, Hq, Hk, D, block_size)
    tables = [
        batch.block_tables[s, : -(-int(batch.context_lens[s]) // block_size)].tolist()
        for s in range(batch.num_seqs)
    ]
    ops = CpuOps()
    whole = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)

    def alone_in(order):
        """Each decode of `order` (indices into runs) in one batch, in that order: its rows."""
        chunks = [ScheduledChunk([0] * runs[s][1], runs[s][0], tables[s], True) for s in order]
        sub = build_batch(chunks, block_size)
        rows = np.concatenate([np.arange(batch.query_start[s], batch.query_start[s + 1]) for s in order])
        return ops.paged_attention(q[rows], k_cache, v_cache, sub, 0.3), rows

    rng = np.random.default_rng(2)
    for order in [[s] for s in range(8)] + [
        list(rng.permutation(9)),
        [8, 3, 1],
        [2, 6],
        list(range(7, -1, -1)),
    ]:
        got, rows = alone_in(order)
        decode_rows = [i for i, s in enumerate(order) if runs[s][1] == 1]
        np.testing.assert_array_equal(got[decode_rows], whole[rows[decode_rows]])


@pytest.mark.parametrize("Hq, Hk, D, block_size", [(8, 4, 8, 16), (12, 3, 24, 5)])
def test_a_short_runs_queries_are_bit_identical_to_decodes(path, Hq, Hk, D, block_size):
    """A verification chunk's query j is the decode at its position: the same bits as that decode alone,
    so speculation changes no attention result."""
    batch, q, k_cache, v_cache = case(4, [(21, 6)], Hq, Hk, D, block_size)
    table = batch.block_tables[0, : -(-27 // block_size)].tolist()
    ops = CpuOps()
    whole = ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
    for j in range(6):
        alone = build_batch([ScheduledChunk([0], 21 + j, table, True)], block_size)
        np.testing.assert_array_equal(
            ops.paged_attention(q[j : j + 1], k_cache, v_cache, alone, 0.3)[0], whole[j]
        )


@needs_kernel
def test_cpu_ops_runs_it_and_keeps_no_decode_kv_memory(monkeypatch):
    """Where the kernel runs, decodes go to it and the caches get no kept decode K/V memory (+48-96 MiB of RSS
    on the peers' models that nothing would read); where it does not, NumPy's path keeps its memory."""
    calls = []
    decode = native_attention.CpuAttention.decode
    monkeypatch.setattr(native_attention.CpuAttention, "decode", lambda *a: calls.append(1) or decode(*a))
    big = (4096, 4, 16, 64)  # 2 x 16 MiB: a cache whose decode K/V NumPy's path would keep
    ops = CpuOps()
    assert native_attention.runs()
    ops.zeros(big)
    assert ops._kept_memory == {}
    batch, q, k_cache, v_cache = case(3, DECODES_FIRST, 8, 4, 8, 16)
    ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
    assert calls == [1]
    monkeypatch.setattr(native_attention, "runs", lambda: False)
    cpu_ops = CpuOps()
    cache = cpu_ops.zeros(big)
    assert list(cpu_ops._kept_memory) == [id(cache)]
    out = cpu_ops.paged_attention(q, k_cache, v_cache, batch, 0.3)
    assert calls == [1]
    check_close(out, reference(q, k_cache, v_cache, batch, 0.3))


@needs_kernel
def test_a_block_outside_the_cache_is_an_error():
    batch, q, k_cache, v_cache = case(4, [(20, 1), (3, 1)], 8, 4, 8, 16)
    batch.block_tables[1, 0] = len(k_cache)
    with pytest.raises(IndexError, match="block table"):
        CpuOps().paged_attention(q, k_cache, v_cache, batch, 0.3)


@needs_kernel
def test_a_context_longer_than_its_table_and_other_dtypes_are_errors():
    """The kernel read past a block-table row into the next sequence's entries (finite, wrong numbers) where a
    context was longer than the row holds, and read float16 q or caches as float32 (past their ends)."""
    batch, q, k_cache, v_cache = case(4, [(20, 1), (3, 1)], 8, 4, 8, 16)
    batch.context_lens[0] = batch.block_tables.shape[1] * 16 + 1
    with pytest.raises(IndexError, match="longer than its block-table row"):
        CpuOps().paged_attention(q, k_cache, v_cache, batch, 0.3)
    batch, q, k_cache, v_cache = case(4, [(20, 1), (3, 1)], 8, 4, 8, 16)
    with pytest.raises(TypeError, match="float32"):
        CpuOps().paged_attention(q.astype(np.float16), k_cache, v_cache, batch, 0.3)
    with pytest.raises(TypeError, match="float32"):
        CpuOps().paged_attention(q, k_cache.astype(np.float16), v_cache.astype(np.float16), batch, 0.3)


@pytest.fixture
def fresh_kernel():
    native_attention.kernel.cache_clear()
    yield
    native_attention.kernel.cache_clear()


def test_turned_off_falls_back_to_numpy(monkeypatch, fresh_kernel):
    monkeypatch.setenv("MINISARATHI_CPU_ATTENTION", "0")
    assert native_attention.kernel() is None and not native_attention.runs()
    batch, q, k_cache, v_cache = case(6, DECODES_BETWEEN, 8, 4, 8, 16)
    check_close(
        CpuOps().paged_attention(q, k_cache, v_cache, batch, 0.3), reference(q, k_cache, v_cache, batch, 0.3)
    )


def test_no_compiler_falls_back_to_numpy(monkeypatch, tmp_path, caplog, fresh_kernel):
    monkeypatch.delenv("MINISARATHI_CPU_ATTENTION", raising=False)
    monkeypatch.setenv("MINISARATHI_CACHE_DIR", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger="minisarathi.backends.cpu.native_attention"):
        assert native_attention.kernel() is None
    assert "native decode attention off" in caplog.text
    batch, q, k_cache, v_cache = case(7, DECODES_FIRST, 8, 4, 8, 16)
    check_close(
        CpuOps().paged_attention(q, k_cache, v_cache, batch, 0.3), reference(q, k_cache, v_cache, batch, 0.3)
    )


@needs_kernel
def test_a_library_that_cannot_load_falls_back_to_numpy(monkeypatch, tmp_path, caplog, fresh_kernel):
    """A corrupt cached library (or one on a noexec mount) makes ctypes raise OSError: NumPy, a warning."""
    monkeypatch.delenv("MINISARATHI_CPU_ATTENTION", raising=False)
    monkeypatch.setenv("MINISARATHI_CACHE_DIR", str(tmp_path))
    library = native_attention.library_path()  # built into tmp_path, not loaded
    library.write_bytes(b"junk")
    with caplog.at_level(logging.WARNING, logger="minisarathi.backends.cpu.native_attention"):
        assert native_attention.kernel() is None
    assert "native decode attention off" in caplog.text and str(library) in caplog.text
