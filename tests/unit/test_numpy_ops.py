"""NumpyOps.zeros (the KV cache's memory): zeros, and resident from the start, not mapped on first write;
NumpyOps.linear's two products against float64."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends.cpu_setup import AVX512_CORES
from minisarathi.backends.numpy_ops import NumpyOps, transposed_linear

# In a fresh interpreter: in this one, memory that earlier tests freed may be reused already resident.
MEASURE = """
import os
import numpy as np
from minisarathi.backends.numpy_ops import NumpyOps

def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = resident_bytes()
cache = NumpyOps().zeros((1024, 4, 16, 256))      # float32, 64 MiB
grown = resident_bytes() - before
assert cache.dtype == np.float32 and cache.nbytes == 64 << 20 and not cache.any()
print(grown)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_zeros_are_resident_at_once():
    done = subprocess.run([sys.executable, "-c", MEASURE], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, check=True)
    grown = int(done.stdout)
    assert grown >= 0.9 * (64 << 20), f"only {grown >> 20} MiB of the 64 MiB cache became resident"


def test_the_transposed_product_is_taken_only_where_it_was_measured_faster():
    """OpenBLAS's AVX-512 kernels, 2 to 128 rows (docs/performance.md, "Weight matmuls: which product")."""
    rows = range(1, 1025)
    for core in AVX512_CORES:
        assert [r for r in rows if transposed_linear(r, core)] == list(range(2, 129))
    assert not any(transposed_linear(r, core) for r in rows for core in ("Haswell", "Zen", "Prescott", None))


@pytest.mark.parametrize("core", ["SkylakeX", "Haswell"])
@pytest.mark.parametrize("rows", [1, 2, 31, 128, 129, 300])
@pytest.mark.parametrize("feature_major", [False, True])   # x as a transposed linear hands it on (F order)
def test_linear_matches_float64_on_both_sides_of_the_threshold(core, rows, feature_major):
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96), dtype=np.float32)
    x = np.asfortranarray(x) if feature_major else x
    w, bias = rng.standard_normal((200, 96), dtype=np.float32), rng.standard_normal(200, dtype=np.float32)
    ops = NumpyOps()
    ops.blas_core = core
    out = ops.linear(x, w, bias)
    want = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    assert out.shape == (rows, 200) and out.dtype == np.float32
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
    # the product it took: the transposed one hands on its [N, T] result's view, in F order
    assert out.flags.c_contiguous == (rows == 1 or not transposed_linear(rows, core))


def test_the_mlp_runs_feature_major_without_a_copy():
    """At the transposed product's rows, gate/up's F-order result stays F-order through silu_and_mul, so the
    down projection gets a C-order [I, T] operand as it is (bench/matmul_layouts.py's "w@xfm")."""
    rng = np.random.default_rng(0)
    ops = NumpyOps()
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
    """x1 * cos - x2 * sin | x2 * cos + x1 * sin in float32, exactly, over a run of batches as a forward makes them:
    new positions (a new batch: the column tables are remade), the same positions layer after layer (kept), q and
    k with different head counts, a batch of one row, feature-major (F-order) activations."""
    ops, rng = NumpyOps(), np.random.default_rng(7)
    Hq, Hk, D, block_size = 4, 2, 8, 4
    cos_sin = rng.standard_normal((64, D)).astype(np.float32)
    k_cache, v_cache = ops.zeros((16, Hk, block_size, D)), ops.zeros((16, Hk, block_size, D))

    def pairwise(x, positions):
        cos, sin = cos_sin[positions, None, :D // 2], cos_sin[positions, None, D // 2:]
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    for T, layers, feature_major in [(5, 3, False), (1, 2, False), (3, 2, True), (5, 2, False)]:
        positions = rng.choice(64, T, replace=False).astype(np.int32)
        slots = rng.choice(16 * block_size, T, replace=False).astype(np.int32)
        for _ in range(layers):
            qkv = rng.standard_normal((T, (Hq + 2 * Hk) * D)).astype(np.float32)
            qkv = np.asfortranarray(qkv) if feature_major else qkv
            original = qkv.copy()
            q, k, v = (qkv[:, :Hq * D].reshape(T, Hq, D), qkv[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D),
                       qkv[:, (Hq + Hk) * D:].reshape(T, Hk, D))
            ops.rope_store_kv(q, k, v, k_cache, v_cache, positions, slots, cos_sin)
            assert np.array_equal(q, pairwise(original[:, :Hq * D].reshape(T, Hq, D), positions))
            assert np.array_equal(qkv[:, Hq * D:], original[:, Hq * D:])
            stored = k_cache[slots // block_size, :, slots % block_size]
            assert np.array_equal(stored, pairwise(original[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D), positions))
            assert np.array_equal(v_cache[slots // block_size, :, slots % block_size], v)
