"""The CUDA backend's matmuls: cublasGemmEx on a handle of our own (minisarathi/backends/cublas.py), run here
on the emulator's libcublas, which holds cuBLAS's column-major meaning and refuses what a capture would not
take; and CuPy's cuBLAS wrapper as the emulator stands it in, which refuses a capturing stream as CuPy
does."""

import ctypes
import platform

import numpy as np
import pytest

from minisarathi.backends import cublas, cuda_ops, emulator
from minisarathi.backends.emulator import cublas as emulated
from minisarathi.dtypes import bf16_to_float32, convert, float32_to_bf16

emulator_only = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)


def stored(values: np.ndarray, dtype: str) -> np.ndarray:
    return convert(values.astype(np.float32), "float32", dtype)


def values(array: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_to_float32(array) if dtype == "bfloat16" else array.astype(np.float64)


def new_gemm() -> tuple[cublas.CublasGemm, np.ndarray]:
    workspace = np.empty(1 << 16, np.uint8)
    return cublas.CublasGemm(emulated.EmulatedCublas(), workspace.ctypes.data, workspace.nbytes), workspace


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("T,N,K", [(1, 7, 5), (3, 16, 24), (5, 33, 9)])
def test_gemm_against_float64(dtype, T, N, K):
    rng = np.random.default_rng(T * N * K)
    x, w = stored(rng.normal(size=(T, K)), dtype), stored(rng.normal(size=(N, K)), dtype)
    bias = stored(rng.normal(size=N), dtype)
    gemm, _workspace = new_gemm()
    out = np.empty((T, N), x.dtype)
    gemm.matmul_t(x, w, out, dtype, False, emulated.LEGACY_STREAM)
    expected = values(x, dtype) @ values(w, dtype).T
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(values(out, dtype), expected, rtol=tolerance, atol=tolerance)
    out[...] = bias
    gemm.matmul_t(x, w, out, dtype, True, emulated.LEGACY_STREAM)  # beta 1: added to what out holds
    np.testing.assert_allclose(
        values(out, dtype), expected + values(bias, dtype), rtol=tolerance, atol=2 * tolerance
    )


@emulator_only
def test_the_backend_linear_is_captured_and_replayed():
    """ops.linear inside a capture is recorded, not run; a replay reads the inputs' current values."""
    ops = cuda_ops.emulated("bfloat16")
    rng = np.random.default_rng(0)
    x = ops.launcher.to_device(float32_to_bf16(rng.normal(size=(4, 24)).astype(np.float32)))
    w = ops.weight(rng.normal(size=(8, 24)).astype(np.float32))
    bias = ops.weight(rng.normal(size=8).astype(np.float32))
    graph, out = ops.launcher.capture(lambda: ops.linear(x, w, bias))
    assert emulator.capturing() is False
    out[...] = 0
    graph.launch()
    eager = ops.linear(x, w, bias)
    np.testing.assert_array_equal(out, eager)
    x[...] = float32_to_bf16(rng.normal(size=(4, 24)).astype(np.float32))
    graph.launch()
    np.testing.assert_array_equal(out, ops.linear(x, w, bias))
    assert not np.array_equal(out, eager)


@emulator_only
def test_a_capture_refuses_a_gemm_bound_to_another_stream_or_without_a_workspace():
    gemm, _workspace = new_gemm()
    x, w = np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)
    out = np.empty((2, 3), np.float32)
    gemm.matmul_t(
        x, w, out, "float32", False, emulated.LEGACY_STREAM
    )  # binds the handle to the legacy stream
    # Called as if the stream were the one bound: during a capture the GEMM would run now, not in the graph.
    with pytest.raises(RuntimeError, match="another stream"):
        emulator.capture(lambda: gemm.matmul_t(x, w, out, "float32", False, emulated.LEGACY_STREAM))
    # cublasSetStream drops the workspace: binding the stream without setting it again is refused in a
    # capture.
    assert gemm.library.cublasSetStream_v2(gemm.handle, emulated.CAPTURE_STREAM) == 0
    gemm.stream = emulated.CAPTURE_STREAM
    with pytest.raises(RuntimeError, match="no workspace"):
        emulator.capture(lambda: gemm.matmul_t(x, w, out, "float32", False, emulated.CAPTURE_STREAM))
    gemm.stream = None  # CublasGemm binds both again when the stream changes: then the capture takes it
    graph, _ = emulator.capture(lambda: gemm.matmul_t(x, w, out, "float32", False, emulated.CAPTURE_STREAM))
    out[...] = 0
    graph.launch()
    np.testing.assert_array_equal(out, np.full((2, 3), 4.0, np.float32))


def old_bf16_gemm(cublas_module, handle: int, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """CupyLauncher._bf16_gemm before it had a handle of its own: CuPy's gemmEx on CuPy's handle."""
    T, K = x.shape
    N = w.shape[0]
    out = np.empty((T, N), dtype=np.uint16)
    alpha, beta = np.array(1.0, dtype=np.float32), np.array(0.0, dtype=np.float32)
    cublas_module.gemmEx(
        handle,
        1,
        0,
        N,
        T,
        K,
        alpha.ctypes.data,
        w.ctypes.data,
        14,
        K,
        x.ctypes.data,
        14,
        K,
        beta.ctypes.data,
        out.ctypes.data,
        14,
        N,
        68,
        -1,
    )
    return out


@emulator_only
def test_cupys_cublas_wrapper_refuses_a_capturing_stream_as_cupy_does():
    """The path graphs took before: on a GPU CuPy raises at the first captured decode step, and so does the
    emulator now. Outside a capture the same calls compute the product."""
    rng = np.random.default_rng(1)
    x = float32_to_bf16(rng.normal(size=(2, 8)).astype(np.float32))
    w = float32_to_bf16(rng.normal(size=(3, 8)).astype(np.float32))
    handle = emulated.get_cublas_handle()
    np.testing.assert_allclose(
        bf16_to_float32(old_bf16_gemm(emulated, handle, x, w)),
        bf16_to_float32(x) @ bf16_to_float32(w).T,
        rtol=1e-2,
        atol=1e-2,
    )
    with pytest.raises(
        NotImplementedError, match="calling cuBLAS API during stream capture is currently unsupported"
    ):
        emulator.capture(lambda: old_bf16_gemm(emulated, handle, x, w))
    assert not emulator.capturing()


def test_the_emulated_library_checks_its_arguments():
    library = emulated.EmulatedCublas()
    handle = ctypes.c_void_p()
    assert library.cublasCreate_v2(ctypes.byref(handle)) == 0
    one = ctypes.c_float(1.0)
    a = np.zeros((4, 4), np.float32)
    # lda smaller than the rows of A: cuBLAS answers CUBLAS_STATUS_INVALID_VALUE
    assert (
        library.cublasGemmEx(
            handle,
            0,
            0,
            4,
            4,
            4,
            ctypes.byref(one),
            a.ctypes.data,
            0,
            3,
            a.ctypes.data,
            0,
            4,
            ctypes.byref(one),
            a.ctypes.data,
            0,
            4,
            68,
            -1,
        )
        == emulated.CUBLAS_STATUS_INVALID_VALUE
    )
    # mixed types are not a GemmEx combination this code uses
    assert (
        library.cublasGemmEx(
            handle,
            0,
            0,
            4,
            4,
            4,
            ctypes.byref(one),
            a.ctypes.data,
            0,
            4,
            a.ctypes.data,
            2,
            4,
            ctypes.byref(one),
            a.ctypes.data,
            0,
            4,
            68,
            -1,
        )
        == emulated.CUBLAS_STATUS_NOT_SUPPORTED
    )
    assert library.cublasSetStream_v2(ctypes.c_void_p(999), 0) == emulated.CUBLAS_STATUS_NOT_INITIALIZED


def test_the_ctypes_prototypes_pass_each_argument_with_its_c_type(tmp_path):
    """CublasGemm over a C library with cuBLAS's prototypes (tests/native/cublas_stub.c): the product is
    right, and the stream, workspace and its size arrive as given, the workspace set after the stream."""
    import shutil
    import subprocess
    from pathlib import Path

    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    stub = tmp_path / "libcublas_stub.so"
    subprocess.run(
        [
            compiler,
            "-O1",
            "-shared",
            "-fPIC",
            "-o",
            str(stub),
            str(Path(__file__).parents[1] / "native" / "cublas_stub.c"),
        ],
        check=True,
    )
    library = cublas.declare(ctypes.CDLL(str(stub)))
    for name in ("stub_stream", "stub_workspace", "stub_workspace_bytes"):
        getattr(library, name).restype = ctypes.c_size_t
    workspace = np.empty(4096, np.uint8)
    gemm = cublas.CublasGemm(library, workspace.ctypes.data, workspace.nbytes)
    rng = np.random.default_rng(2)
    x, w = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=(4, 5)).astype(np.float32)
    out = np.full((3, 4), 0.5, np.float32)
    gemm.matmul_t(x, w, out, "float32", True, 0x7F001234)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T + 0.5, rtol=1e-5, atol=1e-6)
    assert library.stub_stream() == 0x7F001234
    assert (library.stub_workspace(), library.stub_workspace_bytes()) == (
        workspace.ctypes.data,
        workspace.nbytes,
    )
    with pytest.raises(RuntimeError, match="cublasGemmEx failed with cublasStatus_t 15"):
        gemm.matmul_t(
            x.astype(np.float16), w.astype(np.float16), out.astype(np.float16), "float16", False, 0x7F001234
        )
