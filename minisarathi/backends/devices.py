"""Which backend runs a model: the device names, "auto" resolved, and the backend object built."""

from __future__ import annotations

import importlib.util

from minisarathi.backends import cuda_ops
from minisarathi.backends.base import Backend
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.reference import ReferenceOps
from minisarathi.config import DEVICES
from minisarathi.dtypes import DTYPES


def resolve_device(device: str) -> str:
    """ "auto" is "cuda" when CuPy is installed and sees a GPU, else "cpu" (CuPy is not imported without
    it)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device != "auto":
        return device
    if importlib.util.find_spec("cupy") is None:
        return "cpu"
    import cupy

    try:
        return "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except cupy.cuda.runtime.CUDARuntimeError:  # no driver, or no device
        return "cpu"


def make_backend(device: str, dtype: str, explicit_dtype: bool = False) -> Backend:
    """The backend for `device`; dtype, usually the checkpoint's, is the CUDA backends' activation dtype
    (emulated or not) and the CPU backend's weight dtype (its activations stay float32: a bf16 or fp16 dtype
    keeps the matrices in 16 bits). The reference computes in float32: another dtype asked for explicitly is
    an error."""
    device = resolve_device(device)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device == "cpu":
        return CpuOps(dtype)
    if device == "reference":
        if explicit_dtype and dtype != "float32":
            raise ValueError(
                f"dtype {dtype!r} needs device 'cpu', 'cuda' or 'cuda-emulated'; device 'reference' "
                "computes in float32"
            )
        return ReferenceOps()  # plain, slow, what tests trust
    if device == "cuda-emulated":
        return cuda_ops.emulated(dtype)  # the very kernels a GPU runs for this dtype, on the CPU
    if resolve_device("auto") != "cuda":
        raise ValueError(
            "device 'cuda' needs CuPy (pip install 'minisarathi[cuda13]' or '[cuda12]') and a "
            "visible GPU; none was found (use device 'cpu', 'auto' or 'cuda-emulated')"
        )
    return cuda_ops.gpu(dtype)  # the checkpoint's dtype on the GPU
