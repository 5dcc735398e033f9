"""The packed matmul kernel (minisarathi/backends/cpu/packed_gemm.py) against float64 NumPy and, bit for bit,
against a NumPy emulation of its chains of fused multiply-adds on every path this CPU runs; its batch
invariance, and CpuOps' fallback to NumPy's matmul where the kernel cannot be built."""

import logging
import tempfile
import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from minisarathi.backends.cpu import native, packed_gemm
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.cpu.packed_gemm import PackedGemm, PackedWeight
from minisarathi.backends.cpu.process_setup import configure_cpu
from minisarathi.bench.random_model import write_random_model
from minisarathi.model.families import load_model
from minisarathi.model.llama import LINEAR_WEIGHTS
from minisarathi.testing import ScheduledChunk, build_batch, fma32

needs_kernel = pytest.mark.skipif(
    packed_gemm.kernel() is None, reason="no AVX2 + FMA CPU or no C++ compiler here"
)
ORDER = ["avx2", "avx512"]


def runs_here(isa: str) -> bool:
    native = packed_gemm.kernel()
    return native is not None and ORDER.index(isa) <= ORDER.index(native.isa)


def fma_chains(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float32[M, N]: each output as the kernel computes it, one chain of fused multiply-adds over k in order
    from 0."""
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for k in range(x.shape[1]):
        acc = fma32(x[:, k, None], w[None, :, k], acc)
    return acc


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


# rows around the register tiles (6 and 12 rows), features around the panels (16 and 32 wide; 4 full ones for
# the AVX2 tiles of 1 and 2 rows), K past the 512-deep K block
@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 5, 6, 8, 11, 12, 13, 37])
@pytest.mark.parametrize("n, k", [(1, 1), (31, 7), (33, 513), (70, 1100), (64, 512), (17, 300)])
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


@pytest.mark.parametrize("isa", ORDER)
@pytest.mark.parametrize("m, n, k", [(1, 70, 1100), (2, 64, 37), (13, 33, 513), (37, 100, 256)])
def test_every_path_is_the_chain_of_fused_multiply_adds(isa, m, n, k):
    """Each path, forced, gives the bits of the NumPy emulation of its one chain per output: so a row's result
    is the same on every path and every machine that runs one."""
    if not runs_here(isa):
        pytest.skip(f"this CPU has no {isa} path")
    rng = np.random.default_rng(m * 31 + n + k)
    x, w = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
    path = PackedGemm(packed_gemm.kernel().lib, isa)
    assert path.isa == isa and path.panel_width == {"avx2": 16, "avx512": 32}[isa]
    packed, want = path.pack(w), fma_chains(x, w)
    for threads in (1, 2, 3):  # threads split the panels: the same chains, whatever the count
        np.testing.assert_array_equal(path.matmul(x, packed, threads), want)


@needs_kernel
def test_the_emulation_tells_other_orders_and_roundings_apart():
    """Negative controls: the same products summed with a rounding after each multiply, or the chain run
    from the last k, differ from the kernel's bits, so the exact comparison above can fail."""
    rng = np.random.default_rng(9)
    x, w = rng.standard_normal((5, 700), dtype=np.float32), rng.standard_normal((40, 700), dtype=np.float32)
    native = packed_gemm.kernel()
    got = native.matmul(x, native.pack(w))
    unfused = np.zeros((5, 40), np.float32)
    for k in range(700):
        unfused = unfused + x[:, k, None] * w[None, :, k]
    assert not np.array_equal(got, unfused)
    assert not np.array_equal(got, fma_chains(x[:, ::-1], w[:, ::-1]))
    np.testing.assert_array_equal(got, fma_chains(x, w))


@needs_kernel
def test_a_path_reads_only_its_own_packing_and_runs_only_where_the_cpu_has_it():
    native = packed_gemm.kernel()
    w = native.pack(np.ones((40, 300), np.float32))
    other = 48 - native.panel_width  # the other path's panel width (16 or 32)
    panels = np.zeros((2, 300, other), np.float32)
    with pytest.raises(ValueError, match=f"packed in panels of {other}"):
        native.matmul(np.ones((1, 300), np.float32), PackedWeight(panels, 40, panels.ctypes.data))
    assert native.matmul(np.ones((1, 300), np.float32), w).tolist() == [[300.0] * 40]
    if not runs_here("avx512"):
        with pytest.raises(ValueError, match="cannot run the avx512 path"):
            PackedGemm(native.lib, "avx512")


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


def test_the_log_names_the_path_and_a_cpu_without_avx2_keeps_numpy(monkeypatch, caplog, fresh_kernel):
    monkeypatch.delenv("MINISARATHI_PACKED_GEMM", raising=False)
    with caplog.at_level(logging.INFO, logger="minisarathi.backends.cpu.packed_gemm"):
        loaded = packed_gemm.kernel()
    if loaded is not None:
        assert f"packed matmul: the {loaded.isa} path, panels of {loaded.panel_width}" in caplog.text
    packed_gemm.kernel.cache_clear()
    monkeypatch.setattr(native, "cpu_flags", lambda text: frozenset({"sse2", "avx", "fma"}))
    with caplog.at_level(logging.INFO, logger="minisarathi.backends.cpu.packed_gemm"):
        assert packed_gemm.kernel() is None
    assert "packed matmul off: the CPU has no avx2; NumPy's instead" in caplog.text
    w = np.ones((8, packed_gemm.MIN_IN_FEATURES), dtype=np.float32)  # deep enough to pack
    assert CpuOps().linear_weight(w) is w


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
