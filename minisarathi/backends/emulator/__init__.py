"""Runs the CUDA kernels of cuda/*.cu on the CPU: g++ against a shim header, one fiber per CUDA thread.

    module = load_module(cuda_dir() / "rms_norm.cu", ["rms_norm_kernel<float>"])
    module.get_function("rms_norm_kernel<float>")(grid, block, (x, w, out, np.int32(h), np.float32(eps)))

See docs/cuda.md.
"""
from .builder import build, cache_dir
from .launcher import ORDERS, EmulatedKernel, EmulatedModule, load_module, schedule
from .bf16 import bf16_to_float32, float32_to_bf16

__all__ = ["ORDERS", "EmulatedKernel", "EmulatedModule", "bf16_to_float32", "build", "cache_dir",
           "float32_to_bf16", "load_module", "schedule"]
