"""Which backend runs a model: the device names, "auto" resolved, and the backend object built."""
from __future__ import annotations

import importlib.util

from minisarathi.backends import cuda_ops
from minisarathi.backends.base import Backend
from minisarathi.backends.numpy_ops import NumpyOps
from minisarathi.config import DEVICES


def resolve_device(device: str) -> str:
    """"auto" is "cuda" when CuPy is installed and sees a GPU, else "cpu" (CuPy is not imported without it)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device != "auto":
        return device
    if importlib.util.find_spec("cupy") is None:
        return "cpu"
    import cupy
    try:
        return "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except cupy.cuda.runtime.CUDARuntimeError:   # no driver, or no device
        return "cpu"


def make_backend(device: str, dtype: str) -> Backend:
    """The backend for `device`; dtype (a checkpoint's) is the CUDA backend's activation dtype on a GPU."""
    device = resolve_device(device)
    if device == "cpu":
        return NumpyOps()
    if device == "cuda-emulated":
        return cuda_ops.emulated()        # float32 on the CPU: exact against the NumPy reference
    if resolve_device("auto") != "cuda":
        raise ValueError("device 'cuda' needs CuPy (pip install 'minisarathi[cuda13]' or '[cuda12]') and a "
                         "visible GPU; none was found (use device 'cpu', 'auto' or 'cuda-emulated')")
    return cuda_ops.gpu(dtype)            # the checkpoint's dtype on the GPU
