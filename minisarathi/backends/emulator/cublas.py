"""The emulator's cuBLAS: libcublas's four calls that minisarathi/backends/cublas.py makes, computed on host
memory with cuBLAS's column-major meaning, and CuPy's cuBLAS wrapper as CuPy behaves.

Where a GPU would fail, or would silently do something else, this refuses:
  - CuPy's wrapper (setStream, and gemmEx, which calls it) raises NotImplementedError on a capturing stream,
    with CuPy's message (cupy_backends/cuda/libs/cublas.pyx).
  - During a capture, a GEMM on a handle bound to another stream would run once, now, and never in the
    graph; one with no workspace of its own would allocate from cuBLAS's default pool. Both are refused.
  - cublasSetStream drops the handle's workspace, as cuBLAS does.
The emulator captures on one stream, CAPTURE_STREAM; outside a capture work goes to LEGACY_STREAM.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np

from minisarathi.backends.emulator.launcher import capturing, submit
from minisarathi.dtypes import bf16_to_float32, float32_to_bf16

LEGACY_STREAM, CAPTURE_STREAM = 0, 0x5EED  # stream "pointers"
CUBLAS_STATUS_SUCCESS, CUBLAS_STATUS_NOT_INITIALIZED, CUBLAS_STATUS_INVALID_VALUE = 0, 1, 7
CUBLAS_STATUS_NOT_SUPPORTED = 15
ELEMENTS = {0: ctypes.c_float, 2: ctypes.c_uint16, 14: ctypes.c_uint16}  # cudaDataType -> element
STORED = {0: np.float32, 2: np.float16, 14: np.uint16}


def current_stream() -> int:
    """The stream the emulator's launches go to now."""
    return CAPTURE_STREAM if capturing() else LEGACY_STREAM


def _value(argument) -> int:
    """An integer handle or pointer as ctypes would pass it (c_void_p, or a plain int)."""
    return (argument.value or 0) if isinstance(argument, ctypes.c_void_p) else int(argument)


def _column_major(pointer: int, dtype_code: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """A view of the rows x cols column-major matrix with leading dimension ld at `pointer` (host memory)."""
    buffer = (ELEMENTS[dtype_code] * (ld * cols)).from_address(pointer)
    return np.frombuffer(buffer, STORED[dtype_code]).reshape(cols, ld).T[:rows]


def _scalar(argument) -> float:
    """A float32 passed by host pointer (ctypes.byref or ctypes.pointer)."""
    return (argument._obj if hasattr(argument, "_obj") else argument.contents).value


def _to_float32(values: np.ndarray, dtype_code: int) -> np.ndarray:
    return bf16_to_float32(values) if dtype_code == 14 else values.astype(np.float32)


class EmulatedCublas:
    """Stands in for the ctypes.CDLL of libcublas (minisarathi.backends.cublas.load_library)."""

    def __init__(self):
        self._handles: dict[int, dict] = {}  # handle -> {"stream": int, "workspace": int | None}
        self._next = itertools.count(1)

    def cublasCreate_v2(self, handle_ref) -> int:
        handle = next(self._next)
        self._handles[handle] = {"stream": LEGACY_STREAM, "workspace": None}
        handle_ref._obj.value = handle
        return CUBLAS_STATUS_SUCCESS

    def cublasSetStream_v2(self, handle, stream) -> int:
        state = self._handles.get(_value(handle))
        if state is None:
            return CUBLAS_STATUS_NOT_INITIALIZED
        state["stream"], state["workspace"] = _value(stream), None  # back to the default workspace pool
        return CUBLAS_STATUS_SUCCESS

    def cublasSetWorkspace_v2(self, handle, workspace, nbytes: int) -> int:
        state = self._handles.get(_value(handle))
        if state is None:
            return CUBLAS_STATUS_NOT_INITIALIZED
        if nbytes and not _value(workspace):
            return CUBLAS_STATUS_INVALID_VALUE
        state["workspace"] = _value(workspace) if nbytes else None
        return CUBLAS_STATUS_SUCCESS

    def cublasGemmEx(
        self,
        handle,
        transa,
        transb,
        m,
        n,
        k,
        alpha,
        A,
        a_type,
        lda,
        B,
        b_type,
        ldb,
        beta,
        C,
        c_type,
        ldc,
        compute_type,
        algo,
    ) -> int:
        state = self._handles.get(_value(handle))
        if state is None:
            return CUBLAS_STATUS_NOT_INITIALIZED
        if not a_type == b_type == c_type or a_type not in ELEMENTS or compute_type != 68:
            return CUBLAS_STATUS_NOT_SUPPORTED
        rows_a, rows_b = (m if transa == 0 else k), (k if transb == 0 else n)
        if lda < max(1, rows_a) or ldb < max(1, rows_b) or ldc < max(1, m):
            return CUBLAS_STATUS_INVALID_VALUE
        if capturing():
            if state["stream"] != CAPTURE_STREAM:
                raise RuntimeError(
                    "cublasGemmEx during a capture on a handle bound to another stream: it would "
                    "run once now, outside the graph (cublasSetStream to the capturing stream)"
                )
            if state["workspace"] is None:
                raise RuntimeError(
                    "cublasGemmEx during a capture with no workspace set: cuBLAS would allocate "
                    "from its default pool (cublasSetWorkspace after every cublasSetStream)"
                )
        alpha_value, beta_value = _scalar(alpha), _scalar(beta)  # host pointer mode: read at the call
        a, b, c = _value(A), _value(B), _value(C)

        def run() -> None:
            op_a = _to_float32(_column_major(a, a_type, rows_a, k if transa == 0 else m, lda), a_type)
            op_b = _to_float32(_column_major(b, b_type, rows_b, n if transb == 0 else k, ldb), b_type)
            out = _column_major(c, c_type, m, n, ldc)
            product = alpha_value * ((op_a if transa == 0 else op_a.T) @ (op_b if transb == 0 else op_b.T))
            if beta_value:
                product += beta_value * _to_float32(out, c_type)
            out[...] = float32_to_bf16(product) if c_type == 14 else product.astype(STORED[c_type])

        submit(run)
        return CUBLAS_STATUS_SUCCESS


# CuPy's wrapper over one library, as cupy.cuda.device.get_cublas_handle() gives CuPy's matmuls their handle.
_CUPY_LIBRARY = EmulatedCublas()


def get_cublas_handle() -> int:
    """cupy.cuda.device.get_cublas_handle: a handle of CuPy's own."""
    handle = ctypes.c_void_p()
    _CUPY_LIBRARY.cublasCreate_v2(ctypes.byref(handle))
    return handle.value


def setStream(handle: int, stream: int) -> None:
    """cupy_backends.cuda.libs.cublas.setStream, which CuPy's matmuls and its gemmEx call first."""
    if stream == CAPTURE_STREAM and capturing():  # runtime.streamIsCapturing(stream)
        raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
    _CUPY_LIBRARY.cublasSetStream_v2(handle, stream)


def gemmEx(
    handle: int,
    transa: int,
    transb: int,
    m: int,
    n: int,
    k: int,
    alpha: int,
    A: int,
    Atype: int,
    lda: int,
    B: int,
    Btype: int,
    ldb: int,
    beta: int,
    C: int,
    Ctype: int,
    ldc: int,
    computeType: int,
    algo: int,
) -> None:
    """cupy_backends.cuda.libs.cublas.gemmEx: the handle put on the current stream, then cublasGemmEx with
    alpha and beta as host addresses of float32 values."""
    setStream(handle, current_stream())
    status = _CUPY_LIBRARY.cublasGemmEx(
        handle,
        transa,
        transb,
        m,
        n,
        k,
        ctypes.pointer(ctypes.c_float.from_address(alpha)),
        A,
        Atype,
        lda,
        B,
        Btype,
        ldb,
        ctypes.pointer(ctypes.c_float.from_address(beta)),
        C,
        Ctype,
        ldc,
        computeType,
        algo,
    )
    if status != CUBLAS_STATUS_SUCCESS:
        raise RuntimeError(f"cublasGemmEx failed with cublasStatus_t {status}")
