"""bfloat16 as raw uint16 bits (NumPy and CuPy have no bfloat16 dtype), rounding to nearest even.

Written with array methods only, so the same functions convert NumPy arrays on the host and CuPy
arrays on the device.
"""
from __future__ import annotations

import numpy as np


def float32_to_bf16(x):
    """uint16 bits of x rounded to the nearest bfloat16 (ties to even); NaN stays a quiet NaN."""
    x = x.astype(np.float32, copy=False) if hasattr(x, "astype") else np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)   # uint16[...]
    rounded[x != x] = 0x7FC0
    return rounded


def bf16_to_float32(bits):
    """float32 values of bfloat16 bits: they are the top half of a float32."""
    bits = bits if hasattr(bits, "astype") else np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)
