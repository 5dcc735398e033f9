"""The packed matmul kernel (minisarathi/backends/cpu/packed_gemm.py) against float64 NumPy, its batch
invariance, and CpuOps' fallback to NumPy's matmul where the kernel cannot be built."""

import logging
import tempfile
import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from minisarathi.backends.cpu import packed_gemm
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.cpu.packed_gemm import PackedWeight
from minisarathi.backends.cpu.process_setup import configure_cpu
from minisarathi.bench.random_model import write_random_model
from minisarathi.model.llama import LINEAR_WEIGHTS, load_model
from minisarathi.testing import ScheduledChunk, build_batch

needs_kernel = pytest.mark.skipif(
    packed_gemm.kernel() is None, reason="no AVX-512 CPU or no C++ compiler here"
)


@pytest.fixture(autouse=True)
def one_blas_thread():
    """Weights are packed only where BLAS runs one thread (packed_gemm.packs), as the engine sets on a busy
    machine."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def reference_and_bound(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x @ w.T in float64, and the error bound of a float32 sum of K products in any order: K u sum |x w|."""
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = x.shape[1] * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
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
@pytest.mark.parametrize("m, n", [(0, 300), (5, 0), (0, 0)])
def test_empty_product_on_a_threads_first_call(m, n):
    """An lm_head gets 0 rows in a step of non-final prefill chunks; a fresh thread has no input tiles yet."""
    kernel = packed_gemm.kernel()
    packed = kernel.pack(np.ones((n, 300), dtype=np.float32))
    results = []
    thread = threading.Thread(
        target=lambda: results.append(kernel.matmul(np.ones((m, 300), np.float32), packed))
    )
    thread.start()
    thread.join()
    assert len(results) == 1 and results[0].shape == (m, n) and results[0].dtype == np.float32


@needs_kernel
def test_a_row_is_bit_identical_whatever_its_batch():
    """Greedy output must not depend on chunk size or batch mix: a row's result is the same alone, at any
    place in a batch of any size (ragged tiles, other rows around it) and across K blocks."""
    rng = np.random.default_rng(1)
    x, w = (
        rng.standard_normal((40, 1100), dtype=np.float32),
        rng.standard_normal((70, 1100), dtype=np.float32),
    )
    kernel = packed_gemm.kernel()
    packed = kernel.pack(w)
    whole = kernel.matmul(x, packed)
    for i in range(len(x)):
        assert np.array_equal(kernel.matmul(x[i : i + 1], packed)[0], whole[i])
    order = rng.permutation(len(x))
    assert np.array_equal(kernel.matmul(x[order], packed), whole[order])
    for start, stop in [(3, 16), (11, 38), (0, 25)]:
        assert np.array_equal(kernel.matmul(x[start:stop], packed), whole[start:stop])


@needs_kernel
def test_cpu_ops_linear_runs_packed_weights():
    ops, rng = CpuOps(), np.random.default_rng(2)
    K = packed_gemm.MIN_IN_FEATURES
    w, bias = rng.standard_normal((45, K), dtype=np.float32), rng.standard_normal(45, dtype=np.float32)
    x = np.asfortranarray(
        rng.standard_normal((19, K), dtype=np.float32)
    )  # as a transposed product hands it on
    packed = ops.linear_weight(ops.weight(w))
    assert isinstance(packed, PackedWeight)
    shallow = w[:, : K - 1].copy()
    assert ops.linear_weight(shallow) is shallow  # the rule: too shallow to gain, NumPy's matmul
    ref, bound = reference_and_bound(x, w)
    assert np.all(np.abs(ops.linear(x, packed, bias) - (ref + bias)) <= bound + 1e-6 * np.abs(ref + bias))


@needs_kernel
def test_packed_only_where_blas_runs_one_thread():
    """The kernel runs one thread: where NumPy may use more, its matmul is kept (process_setup's count in
    force)."""
    w = np.ones((8, packed_gemm.MIN_IN_FEATURES), dtype=np.float32)  # deep enough to pack
    with threadpool_limits(limits=2, user_api="blas"):
        assert CpuOps().linear_weight(w) is w
    configure_cpu(1)  # as LLMEngine does before the model loads, blas_threads=1
    assert isinstance(CpuOps().linear_weight(w), PackedWeight)


@pytest.fixture
def fresh_kernel():
    packed_gemm.kernel.cache_clear()
    yield
    packed_gemm.kernel.cache_clear()


def test_turned_off_falls_back_to_numpy(monkeypatch, fresh_kernel):
    monkeypatch.setenv("MINISARATHI_PACKED_GEMM", "0")
    ops, w = CpuOps(), np.ones((8, packed_gemm.MIN_IN_FEATURES), dtype=np.float32)  # deep enough to pack
    assert ops.linear_weight(w) is w
    assert np.array_equal(
        ops.linear(np.ones((3, w.shape[1]), dtype=np.float32), w), np.full((3, 8), w.shape[1])
    )


def test_no_compiler_falls_back_to_numpy(monkeypatch, tmp_path, caplog, fresh_kernel):
    monkeypatch.delenv("MINISARATHI_PACKED_GEMM", raising=False)
    monkeypatch.setenv("MINISARATHI_CACHE_DIR", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger="minisarathi.backends.cpu.packed_gemm"):
        assert packed_gemm.kernel() is None
    assert "packed matmul off" in caplog.text
    w = np.ones((8, packed_gemm.MIN_IN_FEATURES), dtype=np.float32)  # deep enough to pack
    assert CpuOps().linear_weight(w) is w


@needs_kernel
def test_a_library_that_cannot_load_falls_back_to_numpy(monkeypatch, tmp_path, caplog, fresh_kernel):
    """A corrupt cached library (or one on a noexec mount) makes ctypes raise OSError: NumPy's matmul, a
    warning."""
    monkeypatch.delenv("MINISARATHI_PACKED_GEMM", raising=False)
    monkeypatch.setenv("MINISARATHI_CACHE_DIR", str(tmp_path))
    library = packed_gemm.library_path()  # built into tmp_path, not loaded
    assert library.parent == tmp_path / "cpu_kernels"
    library.write_bytes(b"junk")
    with caplog.at_level(logging.WARNING, logger="minisarathi.backends.cpu.packed_gemm"):
        assert packed_gemm.kernel() is None
    assert "packed matmul off" in caplog.text and str(library) in caplog.text
    w = np.ones((8, packed_gemm.MIN_IN_FEATURES), dtype=np.float32)  # deep enough to pack
    assert CpuOps().linear_weight(w) is w


@needs_kernel
def test_no_safe_cache_folder_falls_back_to_numpy(monkeypatch, tmp_path, caplog, fresh_kernel):
    monkeypatch.delenv("MINISARATHI_PACKED_GEMM", raising=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MINISARATHI_CACHE_DIR", str(blocker / "cache"))  # cannot be made
    monkeypatch.setattr(tempfile, "tempdir", str(blocker))  # nor can the temporary folder
    with caplog.at_level(logging.WARNING, logger="minisarathi.backends.cpu.packed_gemm"):
        assert packed_gemm.kernel() is None
    assert "no cache folder" in caplog.text


@needs_kernel
def test_a_model_packs_its_linear_weights_and_matches_numpy(tmp_path, monkeypatch, fresh_kernel):
    """LlamaModel hands every weight that only linear reads (the layers' projections, the lm_head) to
    linear_weight; its logits match the same model on NumPy's matmul."""
    path = write_random_model(
        tmp_path / "model", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512
    )
    prompt = np.random.default_rng(3).integers(3, 512, 45).tolist()
    logits = []
    for setting in ("1", "0"):
        monkeypatch.setenv("MINISARATHI_PACKED_GEMM", setting)
        packed_gemm.kernel.cache_clear()
        model = load_model(path)
        weights = [model.lm_head] + [
            getattr(layer, name) for layer in model.layers for name in LINEAR_WEIGHTS
        ]
        assert all(isinstance(w, PackedWeight) == (setting == "1") for w in weights)
        batch = build_batch([ScheduledChunk(prompt, 0, [0, 1, 2], True)], 16)
        batch.logits_indices = np.arange(batch.num_tokens, dtype=np.int32)
        logits.append(model.forward(batch, model.new_kv_cache(3, 16)))
    packed, numpy = logits
    assert np.abs(packed - numpy).max() <= 1e-5 * np.abs(numpy).max()
