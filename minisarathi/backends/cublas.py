"""Matmuls through cublasGemmEx on a cuBLAS handle of our own, so that CUDA graphs can capture them.

CuPy's cuBLAS wrapper refuses every call while the current stream is capturing (setStream in
cupy_backends/cuda/libs/cublas.pyx raises NotImplementedError; CuPy issue 6290), and `x @ w.T` goes through
it. cuBLAS itself records into a capture when its handle is bound to the capturing stream and has a workspace
of its own (cuBLAS docs, "CUDA Graphs Support"). So the CUDA backend calls libcublas through ctypes: the
library CuPy loaded, one handle, a static workspace attached again whenever the handle's stream changes
(cublasSetStream resets the workspace to cuBLAS's default pool, which allocates).

The emulator runs this same code over its stand-in for libcublas (emulator/cublas.py).

    gemm = CublasGemm(load_library(), workspace_address, WORKSPACE_BYTES)
    gemm.matmul_t(x, w, out, accumulate=False, stream=stream_pointer)   # out[T, N] = x[T, K] @ w[N, K].T
"""

from __future__ import annotations

import ctypes

CUBLAS_STATUS_SUCCESS = 0
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68  # float32 accumulation for every type, as CuPy's own matmuls
CUBLAS_GEMM_DEFAULT = -1
DATA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}  # cudaDataType: CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF
WORKSPACE_BYTES = 32 * 1024 * 1024  # the cuBLAS docs' advice for Hopper (docs/cuda.md)


def address(array) -> int:
    """The data address of a CuPy or NumPy array (a device pointer, or the emulator's host one)."""
    return array.data.ptr if hasattr(array.data, "ptr") else array.ctypes.data


def load_library() -> ctypes.CDLL:
    """libcublas as CuPy loaded it (cupy-cuda12x: libcublas.so.12, cupy-cuda13x: .so.13)."""
    from cupy.cuda import runtime

    # The attribute access, not a plain import: CuPy 14 finds libcublas (pip or system) through
    # cuda.pathfinder in the package's __getattr__ before it imports the binding.
    from cupy_backends.cuda.libs import cublas  # noqa: F401

    name = f"/libcublas.so.{runtime.runtimeGetVersion() // 1000}"  # the major CuPy was built for
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if name in line})
    if not paths:
        raise RuntimeError(f"CuPy's cuBLAS binding is imported but no {name[1:]} is mapped into the process")
    return declare(ctypes.CDLL(paths[0]))


def declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """The library with the C prototypes of the four calls made here (cublas_api.h), so ctypes passes each
    argument with its C type."""
    void_p, c_int = ctypes.c_void_p, ctypes.c_int
    library.cublasCreate_v2.argtypes = [ctypes.POINTER(void_p)]
    library.cublasSetStream_v2.argtypes = [void_p, void_p]
    library.cublasSetWorkspace_v2.argtypes = [void_p, void_p, ctypes.c_size_t]
    library.cublasGemmEx.argtypes = [
        void_p,
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        void_p,
        void_p,
        c_int,
        c_int,
        void_p,
        c_int,
        c_int,
        void_p,
        void_p,
        c_int,
        c_int,
        c_int,
        c_int,
    ]
    for function in ("cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGemmEx"):
        getattr(library, function).restype = c_int
    return library


def _check(status: int, call: str) -> None:
    if status != CUBLAS_STATUS_SUCCESS:
        raise RuntimeError(f"{call} failed with cublasStatus_t {status}")


class CublasGemm:
    """out[T, N] = x[T, K] @ w[N, K].T (+ out) on one handle, in the stream given at each call."""

    def __init__(self, library, workspace: int, workspace_bytes: int):
        self.library = library
        self.handle = ctypes.c_void_p()
        _check(library.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.workspace, self.workspace_bytes = workspace, workspace_bytes
        self.stream: int | None = None
        # Host scalars: cuBLAS reads them at the call, and a capture keeps their values.
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _bind(self, stream: int) -> None:
        if stream != self.stream:
            _check(self.library.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")
            _check(
                self.library.cublasSetWorkspace_v2(
                    self.handle, ctypes.c_void_p(self.workspace), self.workspace_bytes
                ),
                "cublasSetWorkspace",
            )
            self.stream = stream

    def matmul_t(self, x, w, out, dtype: str, accumulate: bool, stream: int) -> None:
        """Writes x[T, K] @ w[N, K].T into out[T, N] (added to what out holds with `accumulate`), all three
        C-contiguous and of `dtype`, accumulated in float32. cuBLAS is column-major: the row-major product is,
        read column-major, out'[N, T] = w'^T[N, K] @ x'[K, T], where w' (K x N) and x' (K x T) are the same
        buffers."""
        T, K = x.shape
        N = w.shape[0]
        self._bind(stream)
        kind = DATA_TYPES[dtype]
        _check(
            self.library.cublasGemmEx(
                self.handle,
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                N,
                T,
                K,
                ctypes.byref(self.one),
                ctypes.c_void_p(address(w)),
                kind,
                K,
                ctypes.c_void_p(address(x)),
                kind,
                K,
                ctypes.byref(self.one if accumulate else self.zero),
                ctypes.c_void_p(address(out)),
                kind,
                N,
                CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT,
            ),
            "cublasGemmEx",
        )
