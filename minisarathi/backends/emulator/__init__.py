"""Runs the CUDA kernels of cuda/*.cu on the CPU: g++ against a shim header, one fiber per CUDA thread.

    module = load_module(cuda_dir() / "rms_norm.cu", ["rms_norm_kernel<float>"])
    module.get_function("rms_norm_kernel<float>")(
        grid, block, (x, w, out, np.int32(h), np.float32(eps), np.int32(1), np.int64(h))
    )

See docs/cuda.md.
"""

from minisarathi.backends.emulator.builder import build
from minisarathi.backends.emulator.device import A100, H100, Device
from minisarathi.backends.emulator.launcher import (
    ORDERS,
    CUDADriverError,
    EmulatedKernel,
    EmulatedModule,
    Graph,
    capture,
    capturing,
    join_side_stream,
    load_module,
    schedule,
    side_stream,
    submit,
)

__all__ = [
    "A100",
    "H100",
    "ORDERS",
    "CUDADriverError",
    "Device",
    "EmulatedKernel",
    "EmulatedModule",
    "Graph",
    "build",
    "capture",
    "capturing",
    "join_side_stream",
    "load_module",
    "schedule",
    "side_stream",
    "submit",
]
