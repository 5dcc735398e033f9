"""CpuOps' ops against float64 (paged attention over scattered blocks, the elementwise ops, RoPE), and its
own tricks: zeros (the KV cache's memory) resident from the start, not mapped on first write; linear's two
products; RoPE's column tables bit for bit the pairwise formula."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends.cpu.ops import CpuOps, transposed_linear
from minisarathi.backends.cpu.process_setup import AVX512_CORES
from minisarathi.config import rope_cos_sin_table
from minisarathi.testing import ScheduledChunk, build_batch

ops = CpuOps()

# In a fresh interpreter: in this one, memory that earlier tests freed may be reused already resident.
MEASURE = """
import os
import numpy as np
from minisarathi.backends.cpu.ops import CpuOps

def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = resident_bytes()
cache = CpuOps().zeros((1024, 4, 16, 256))      # float32, 64 MiB
grown = resident_bytes() - before
assert cache.dtype == np.float32 and cache.nbytes == 64 << 20 and not cache.any()
print(grown)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.system  # a fresh interpreter measures its own memory
def test_zeros_are_resident_at_once():
    done = subprocess.run(
        [sys.executable, "-c", MEASURE],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
    )
    grown = int(done.stdout)
    assert grown >= 0.9 * (64 << 20), f"only {grown >> 20} MiB of the 64 MiB cache became resident"


def test_the_transposed_product_is_taken_only_where_it_was_measured_faster():
    """OpenBLAS's AVX-512 kernels, 2 to 128 rows (docs/cpu_performance.md, "Weight matmuls")."""
    rows = range(1, 1025)
    for core in AVX512_CORES:
        assert [r for r in rows if transposed_linear(r, core)] == list(range(2, 129))
    assert not any(transposed_linear(r, core) for r in rows for core in ("Haswell", "Zen", "Prescott", None))


@pytest.mark.parametrize("core", ["SkylakeX", "Haswell"])
@pytest.mark.parametrize("rows", [1, 2, 31, 128, 129, 300])
@pytest.mark.parametrize("feature_major", [False, True])  # x as a transposed linear hands it on (F order)
def test_linear_matches_float64_on_both_sides_of_the_threshold(core, rows, feature_major):
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96), dtype=np.float32)
    x = np.asfortranarray(x) if feature_major else x
    w, bias = rng.standard_normal((200, 96), dtype=np.float32), rng.standard_normal(200, dtype=np.float32)
    ops = CpuOps()
    ops.blas_core = core
    out = ops.linear(x, w, bias)
    want = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    assert out.shape == (rows, 200) and out.dtype == np.float32
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
    # the product it took: the transposed one hands on its [N, T] result's view, in F order
    assert out.flags.c_contiguous == (rows == 1 or not transposed_linear(rows, core))


def test_the_mlp_runs_feature_major_without_a_copy():
    """At the transposed product's rows, gate/up's F-order result stays F-order through silu_and_mul, so the
    down projection gets a C-order [I, T] operand as it is (docs/cpu_performance.md, "Weight matmuls")."""
    rng = np.random.default_rng(0)
    ops = CpuOps()
    ops.blas_core = "SkylakeX"
    x = rng.standard_normal((32, 64), dtype=np.float32)
    gate_up = rng.standard_normal((2 * 48, 64), dtype=np.float32)
    down = rng.standard_normal((64, 48), dtype=np.float32)
    act = ops.silu_and_mul(ops.linear(x, gate_up))
    assert act.flags.f_contiguous and not act.flags.c_contiguous
    out = ops.linear(act, down)
    x64 = x.astype(np.float64) @ gate_up.T.astype(np.float64)
    g, u = x64[:, :48], x64[:, 48:]
    want = (g / (1 + np.exp(-g)) * u) @ down.T.astype(np.float64)
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()


def test_rope_store_kv_is_the_pairwise_float32_formula_bit_for_bit_batch_after_batch():
    """x1 * cos - x2 * sin | x2 * cos + x1 * sin in float32, exactly, over a run of batches as a forward makes
    them: new positions (a new batch: the column tables are remade), the same positions layer after layer
    (kept), q and k with different head counts, a batch of one row, feature-major (F-order) activations."""
    ops, rng = CpuOps(), np.random.default_rng(7)
    Hq, Hk, D, block_size = 4, 2, 8, 4
    cos_sin = rng.standard_normal((64, D)).astype(np.float32)
    k_cache, v_cache = ops.zeros((16, Hk, block_size, D)), ops.zeros((16, Hk, block_size, D))

    def pairwise(x, positions):
        cos, sin = cos_sin[positions, None, : D // 2], cos_sin[positions, None, D // 2 :]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    for T, layers, feature_major in [(5, 3, False), (1, 2, False), (3, 2, True), (5, 2, False)]:
        positions = rng.choice(64, T, replace=False).astype(np.int32)
        slots = rng.choice(16 * block_size, T, replace=False).astype(np.int32)
        for _ in range(layers):
            qkv = rng.standard_normal((T, (Hq + 2 * Hk) * D)).astype(np.float32)
            qkv = np.asfortranarray(qkv) if feature_major else qkv
            original = qkv.copy()
            q, k, v = (
                qkv[:, : Hq * D].reshape(T, Hq, D),
                qkv[:, Hq * D : (Hq + Hk) * D].reshape(T, Hk, D),
                qkv[:, (Hq + Hk) * D :].reshape(T, Hk, D),
            )
            ops.rope_store_kv(q, k, v, k_cache, v_cache, positions, slots, cos_sin)
            assert np.array_equal(q, pairwise(original[:, : Hq * D].reshape(T, Hq, D), positions))
            assert np.array_equal(qkv[:, Hq * D :], original[:, Hq * D :])
            stored = k_cache[slots // block_size, :, slots % block_size]
            k_original = original[:, Hq * D : (Hq + Hk) * D].reshape(T, Hk, D)
            assert np.array_equal(stored, pairwise(k_original, positions))
            assert np.array_equal(v_cache[slots // block_size, :, slots % block_size], v)


# (history, query tokens) per sequence
RUNS = {
    "mixed": lambda block_size: [
        (0, 5),
        (7, 1),
        (13, 4),
        (0, 1),
        (30, 1),
        (2, 9),
        (block_size, 1),
        (block_size - 1, 1),
        (5, 300),
    ],  # 300: several query tiles
    "equal decodes": lambda block_size: [(20, 1), (20, 1), (3, 6), (20, 1)],  # no padding mask
    "long decodes": lambda block_size: [(450, 1), (3, 6), (400, 1)],
}  # scores computed transposed


@pytest.mark.parametrize("runs", RUNS)
@pytest.mark.parametrize("Hq, Hk, D, block_size", [(6, 2, 10, 3), (3, 3, 6, 5), (4, 1, 8, 1), (8, 4, 8, 16)])
def test_paged_attention_matches_dense_float64(Hq, Hk, D, block_size, runs):
    rng = np.random.default_rng(Hq * 100 + D)
    runs = RUNS[runs](block_size)
    lengths = [-(-(h + q) // block_size) for h, q in runs]
    num_blocks = sum(lengths) + 2
    pool = rng.permutation(num_blocks).tolist()
    tables = [[pool.pop() for _ in range(n)] for n in lengths]
    # Garbage everywhere first: slots no sequence owns must never change the result.
    k_cache = rng.standard_normal((num_blocks, Hk, block_size, D)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, Hk, block_size, D)).astype(np.float32)
    keys = [rng.standard_normal((h + q, Hk, D)).astype(np.float32) for h, q in runs]
    values = [rng.standard_normal((h + q, Hk, D)).astype(np.float32) for h, q in runs]
    whole = build_batch(
        [ScheduledChunk([0] * (h + q), 0, t, True) for (h, q), t in zip(runs, tables)], block_size
    )
    ops.store_kv(np.concatenate(keys), np.concatenate(values), k_cache, v_cache, whole.slot_mapping)

    batch = build_batch([ScheduledChunk([0] * q, h, t, True) for (h, q), t in zip(runs, tables)], block_size)
    q = rng.standard_normal((batch.num_tokens, Hq, D)).astype(np.float32)
    scale = D**-0.5
    out = ops.paged_attention(q, k_cache, v_cache, batch, scale)
    assert out.shape == (batch.num_tokens, Hq, D) and out.dtype == np.float32

    G = Hq // Hk
    for s, (h, n) in enumerate(runs):
        rows = slice(batch.query_start[s], batch.query_start[s + 1])
        for head in range(Hq):
            qs = q[rows, head].astype(np.float64)
            k, v = keys[s][:, head // G].astype(np.float64), values[s][:, head // G].astype(np.float64)
            scores = qs @ k.T * scale
            scores[np.arange(h + n)[None, :] > h + np.arange(n)[:, None]] = -np.inf
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            want = (p / p.sum(axis=1, keepdims=True)) @ v
            assert np.abs(out[rows, head] - want).max() < 1e-5


def test_store_kv_writes_the_mapped_slots():
    k_cache, v_cache = np.zeros((3, 2, 4, 5), np.float32), np.zeros((3, 2, 4, 5), np.float32)
    k = np.arange(2 * 2 * 5, dtype=np.float32).reshape(2, 2, 5)
    ops.store_kv(k, -k, k_cache, v_cache, np.array([9, 2], dtype=np.int32))
    assert np.array_equal(k_cache[2, :, 1], k[0]) and np.array_equal(k_cache[0, :, 2], k[1])
    assert np.array_equal(v_cache[2, :, 1], -k[0]) and np.count_nonzero(k_cache) == np.count_nonzero(k)
    before = k_cache.copy()
    ops.store_kv(k + 100, k, k_cache, v_cache, np.array([-1, 5], dtype=np.int32))  # negative slot: padding
    assert np.array_equal(k_cache[1, :, 1], k[1] + 100)
    k_cache[1, :, 1] = before[1, :, 1]
    assert np.array_equal(k_cache, before)


def test_elementwise_ops_match_float64():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 12)).astype(np.float32)
    w = rng.standard_normal(12).astype(np.float32)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want_norm = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-5) * w64
    assert np.abs(ops.rms_norm(x, w, 1e-5) - want_norm).max() < 1e-5

    residual = rng.standard_normal((5, 12)).astype(np.float32)
    want_residual = residual.astype(np.float64) + x64
    normed, new_residual = ops.add_rms_norm(x, residual, w, 1e-5)
    assert new_residual is residual and np.abs(residual - want_residual).max() < 1e-6
    want = want_residual / np.sqrt((want_residual**2).mean(axis=1, keepdims=True) + 1e-5) * w64
    assert np.abs(normed - want).max() < 1e-5

    gate_up = rng.standard_normal((5, 8)).astype(np.float32) * 30
    g, u = gate_up[:, :4].astype(np.float64), gate_up[:, 4:].astype(np.float64)
    assert np.abs(ops.silu_and_mul(gate_up) - g / (1 + np.exp(-g)) * u).max() < 1e-4

    weight, bias = rng.standard_normal((7, 12)).astype(np.float32), rng.standard_normal(7).astype(np.float32)
    assert np.abs(ops.linear(x, weight, bias) - (x64 @ weight.T.astype(np.float64) + bias)).max() < 1e-5
    assert np.array_equal(ops.embedding(weight, np.array([3, 0, 3])), weight[[3, 0, 3]])


def test_rope_store_kv_rotates_q_in_place_and_stores_rotated_k_and_v():
    rng = np.random.default_rng(2)
    T, Hq, Hk, D, block_size = 6, 4, 2, 8, 4
    qkv = rng.standard_normal((T, (Hq + 2 * Hk) * D)).astype(np.float32)
    original = qkv.astype(np.float64)
    q, k, v = (
        qkv[:, : Hq * D].reshape(T, Hq, D),
        qkv[:, Hq * D : (Hq + Hk) * D].reshape(T, Hk, D),
        qkv[:, (Hq + Hk) * D :].reshape(T, Hk, D),
    )
    positions = np.array([0, 1, 2, 50, 51, 100000], dtype=np.int32)
    slots = np.array([3, 0, 9, -1, 4, 11], dtype=np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    k_cache, v_cache = ops.zeros((3, Hk, block_size, D)), ops.zeros((3, Hk, block_size, D))
    cos_sin = ops.constant(rope_cos_sin_table(inv_freq, 100001))
    ops.rope_store_kv(q, k, v, k_cache, v_cache, positions, slots, cos_sin)
    angle = positions[:, None, None].astype(np.float64) * inv_freq.astype(np.float64)  # [T, 1, D/2]

    def rotated(start, heads):
        x = original[:, start : start + heads * D].reshape(T, heads, D)
        # half-split pairs as complex numbers
        want = (x[..., : D // 2] + 1j * x[..., D // 2 :]) * np.exp(1j * angle)
        return np.concatenate([want.real, want.imag], axis=-1)

    assert np.abs(q - rotated(0, Hq)).max() < 1e-4  # exact to float32 even at position 100000
    assert np.array_equal(qkv[:, Hq * D :], original[:, Hq * D :].astype(np.float32))  # k and v untouched
    want_k, want_v = np.zeros_like(k_cache), np.zeros_like(v_cache)
    for t, slot in enumerate(slots):
        if slot >= 0:  # -1: a padding token, stored nowhere
            want_k[slot // block_size, :, slot % block_size] = rotated(Hq * D, Hk)[t]
            want_v[slot // block_size, :, slot % block_size] = v[t]
    assert np.abs(k_cache - want_k).max() < 1e-4 and np.array_equal(v_cache, want_v)
