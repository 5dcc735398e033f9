"""The packed matmul kernel (minisarathi/backends/packed_gemm.py) against float64 NumPy, its batch invariance,
and NumpyOps' fallback to NumPy's matmul where the kernel cannot be built."""
import logging

import numpy as np
import pytest

from minisarathi.backends import packed_gemm
from minisarathi.backends.numpy_ops import NumpyOps
from minisarathi.backends.packed_gemm import PackedWeight

needs_kernel = pytest.mark.skipif(packed_gemm.kernel() is None, reason="no AVX-512 CPU or no C++ compiler here")


def reference_and_bound(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x @ w.T in float64, and the error bound of a float32 sum of K products in any order: K u sum |x w|."""
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = x.shape[1] * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
    return ref, bound + 1e-30


# rows around the 12-row register tile, features around the 32-wide panel, K past the 512-deep K block
@needs_kernel
@pytest.mark.parametrize("m", [1, 11, 12, 13, 37])
@pytest.mark.parametrize("n, k", [(1, 1), (31, 7), (33, 513), (70, 1100), (64, 512)])
def test_matches_float64(m, n, k):
    rng = np.random.default_rng(m * 10007 + n * 101 + k)
    x, w = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
    kernel = packed_gemm.kernel()
    packed = kernel.pack(w)
    assert packed.shape == (n, k) and packed.panels.ctypes.data % 64 == 0
    got = kernel.matmul(x, packed)
    assert got.shape == (m, n) and got.dtype == np.float32 and got.flags.c_contiguous
    ref, bound = reference_and_bound(x, w)
    assert np.all(np.abs(got - ref) <= bound)


@needs_kernel
def test_a_row_is_bit_identical_whatever_its_batch():
    """Greedy output must not depend on chunk size or batch mix: a row's result is the same alone, at any
    place in a batch of any size (ragged tiles, other rows around it) and across K blocks."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((40, 1100), dtype=np.float32), rng.standard_normal((70, 1100), dtype=np.float32)
    kernel = packed_gemm.kernel()
    packed = kernel.pack(w)
    whole = kernel.matmul(x, packed)
    for i in range(len(x)):
        assert np.array_equal(kernel.matmul(x[i:i + 1], packed)[0], whole[i])
    order = rng.permutation(len(x))
    assert np.array_equal(kernel.matmul(x[order], packed), whole[order])
    for start, stop in [(3, 16), (11, 38), (0, 25)]:
        assert np.array_equal(kernel.matmul(x[start:stop], packed), whole[start:stop])


@needs_kernel
def test_numpy_ops_linear_runs_packed_weights():
    ops, rng = NumpyOps(), np.random.default_rng(2)
    w, bias = rng.standard_normal((45, 80), dtype=np.float32), rng.standard_normal(45, dtype=np.float32)
    x = np.asfortranarray(rng.standard_normal((19, 80), dtype=np.float32))   # as a transposed product hands it on
    packed = ops.linear_weight(ops.weight(w))
    assert isinstance(packed, PackedWeight)
    ref, bound = reference_and_bound(x, w)
    assert np.all(np.abs(ops.linear(x, packed, bias) - (ref + bias)) <= bound + 1e-6 * np.abs(ref + bias))


@pytest.fixture
def fresh_kernel():
    packed_gemm.kernel.cache_clear()
    yield
    packed_gemm.kernel.cache_clear()


def test_turned_off_falls_back_to_numpy(monkeypatch, fresh_kernel):
    monkeypatch.setenv("MINISARATHI_PACKED_GEMM", "0")
    ops, w = NumpyOps(), np.ones((8, 4), dtype=np.float32)
    assert ops.linear_weight(w) is w
    assert np.array_equal(ops.linear(np.ones((3, 4), dtype=np.float32), w), np.full((3, 8), 4.0))


def test_no_compiler_falls_back_to_numpy(monkeypatch, tmp_path, caplog, fresh_kernel):
    monkeypatch.setenv("MINISARATHI_CACHE_DIR", str(tmp_path))   # nothing built yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger="minisarathi.backends.packed_gemm"):
        assert packed_gemm.kernel() is None
    assert "packed matmul off" in caplog.text
    w = np.ones((8, 4), dtype=np.float32)
    assert NumpyOps().linear_weight(w) is w
