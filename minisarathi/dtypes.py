"""The floating-point element types: their names, how arrays store them, and conversions between them.

bfloat16 has no NumPy (or CuPy) dtype: such arrays hold its raw bits as uint16. The conversions use array
methods only, so the same functions convert NumPy arrays on the host and CuPy arrays on the device.
"""

from __future__ import annotations

import numpy as np

DTYPES = ("float32", "float16", "bfloat16")
STORAGE_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}


def float32_to_bf16(x):
    """uint16 bits of x rounded to the nearest bfloat16 (ties to even); NaN stays a quiet NaN."""
    x = x.astype(np.float32, copy=False) if hasattr(x, "astype") else np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # uint16[...]
    rounded[x != x] = 0x7FC0
    return rounded


def bf16_to_float32(bits):
    """float32 values of bfloat16 bits: bfloat16 is the top half of a float32, so shift and reinterpret."""
    bits = bits if hasattr(bits, "astype") else np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def dtype_name(array) -> str:
    """ "float32", "float16" or "bfloat16" (uint16 bits) of an array."""
    name = array.dtype.name
    if name in ("uint16", "bfloat16"):
        return "bfloat16"
    if name not in ("float32", "float16"):
        raise ValueError(f"array dtype must be float32, float16 or bfloat16 (uint16 bits), got {name}")
    return name


def to_float32(x, dtype: str):
    """The float32 values of x stored as `dtype` (exact: every 16-bit value is a float32 value)."""
    return bf16_to_float32(x) if dtype == "bfloat16" else x.astype(np.float32, copy=False)


def convert(x, from_dtype: str, to_dtype: str):
    """x, stored as from_dtype, stored as to_dtype (rounding to nearest even)."""
    if from_dtype == to_dtype:
        return x
    values = to_float32(x, from_dtype)
    return float32_to_bf16(values) if to_dtype == "bfloat16" else values.astype(STORAGE_DTYPES[to_dtype])
