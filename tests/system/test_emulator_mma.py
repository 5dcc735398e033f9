"""The emulator's tensor-core instructions (mma.sync m16n8k16, ldmatrix x1/x2/x4 [.trans]) against NumPy.

The kernels in tests/kernels/mma_checks.cu lay elements into fragments by the PTX ISA's tables; the
expected values here come from plain matrix products and from the ISA's ldmatrix rule written in NumPy.
A deliberately mis-indexed A fragment must give the product of the wrongly laid-out matrix, as on a GPU.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends import emulator
from minisarathi.dtypes import bf16_to_float32, float32_to_bf16
from minisarathi.paths import cuda_dir

CHECKS = Path(__file__).parents[1] / "kernels" / "mma_checks.cu"
TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
KERNELS = [f"{k}<{t}>" for k in ("mma_from_global", "ldmatrix_mma", "pack_pairs") for t in TYPES.values()]
KERNELS.append("ldmatrix_registers")
pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)


@pytest.fixture(scope="module")
def module():
    return emulator.load_module(CHECKS, KERNELS, (cuda_dir(),))


@pytest.fixture(params=[("forward", 0), ("reverse", 0), ("random", 7)], ids=["forward", "reverse", "random"])
def order(request):
    with emulator.schedule(*request.param):
        yield request.param[0]


def random_16bit(rng, shape, dtype):
    """(device array, its float64 values) of standard normal numbers rounded to dtype."""
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bfloat16":
        bits = float32_to_bf16(x)
        return bits, bf16_to_float32(bits).astype(np.float64)
    half = x.astype(np.float16)
    return half, half.astype(np.float64)


def mma(module, dtype, a, b, c, misindex):
    out = np.full((16, 8), np.nan, np.float32)
    module.get_function(f"mma_from_global<{TYPES[dtype]}>")((1,), (32,), (a, b, c, out, np.int32(misindex)))
    return out


@pytest.mark.parametrize("dtype", TYPES)
def test_mma_m16n8k16_matches_numpy(module, order, dtype):
    rng = np.random.default_rng(1)
    (a, a64), (b, b64) = random_16bit(rng, (16, 16), dtype), random_16bit(rng, (16, 8), dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    # Products of 16-bit values are exact in fp32; only the fp32 sum of 16 terms rounds.
    np.testing.assert_allclose(mma(module, dtype, a, b, c, 0), a64 @ b64 + c, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", TYPES)
def test_misindexed_fragment_gives_the_wrong_product(module, order, dtype):
    """Negative control: swapping a[1] and a[2] feeds the tensor core A with its off-diagonal 8x8 blocks
    exchanged. The emulator must compute exactly that wrong product, far from the right one."""
    rng = np.random.default_rng(2)
    (a, a64), (b, b64) = random_16bit(rng, (16, 16), dtype), random_16bit(rng, (16, 8), dtype)
    c = np.zeros((16, 8), np.float32)
    out = mma(module, dtype, a, b, c, 1)
    assert np.abs(out - a64 @ b64).max() > 1.0
    swapped = a64.copy()
    swapped[8:, :8], swapped[:8, 8:] = a64[:8, 8:], a64[8:, :8]
    np.testing.assert_allclose(out, swapped @ b64, rtol=0, atol=2e-5)


def ldmatrix_expected(m: np.ndarray, rows: np.ndarray, count: int, trans: bool) -> np.ndarray:
    """uint32[32, 4]: the PTX ISA's ldmatrix rule. Matrix i's row r is at the address lane 8i + r gives;
    lane l gets M_i[l/4][2(l%4) + {0,1}], or with .trans M_i[2(l%4) + {0,1}][l/4]."""
    out = np.zeros((32, 4), np.uint32)
    for i in range(count):
        matrix = m[rows[8 * i : 8 * i + 8]].astype(np.uint32)  # [8 rows, 8 elements]
        if trans:
            matrix = matrix.T
        for lane in range(32):
            g, t = divmod(lane, 4)
            out[lane, i] = matrix[g, 2 * t] | matrix[g, 2 * t + 1] << 16
    return out


@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_ldmatrix_registers(module, order, count, trans):
    rng = np.random.default_rng(count + 10 * trans)
    m = rng.integers(0, 1 << 16, size=(32, 8), dtype=np.uint16)
    rows = rng.permutation(32).astype(np.int32)
    out = np.zeros((32, 4), np.uint32)
    module.get_function("ldmatrix_registers")((1,), (32,), (m, rows, out, np.int32(count), np.int32(trans)))
    np.testing.assert_array_equal(out, ldmatrix_expected(m, rows, count, trans))


@pytest.mark.parametrize("dtype", TYPES)
def test_ldmatrix_feeds_mma_as_attention_kernels_do(module, order, dtype):
    rng = np.random.default_rng(3)
    (a, a64), (b, b64) = random_16bit(rng, (16, 16), dtype), random_16bit(rng, (16, 16), dtype)
    bt = np.ascontiguousarray(b.T)
    out, out2 = np.full((16, 16), np.nan, np.float32), np.full((16, 16), np.nan, np.float32)
    module.get_function(f"ldmatrix_mma<{TYPES[dtype]}>")((1,), (32,), (a, b, bt, out, out2))
    np.testing.assert_allclose(out, a64 @ b64, rtol=0, atol=2e-5)  # B via ldmatrix .trans (V-like)
    np.testing.assert_allclose(out2, a64 @ b64, rtol=0, atol=2e-5)  # B^T via ldmatrix (K-like)


@pytest.mark.parametrize("dtype", TYPES)
def test_pack2_rounds_to_nearest_even_low_half_first(module, dtype):
    x = np.random.default_rng(4).standard_normal(64).astype(np.float32)
    out = np.zeros(32, np.uint32)
    module.get_function(f"pack_pairs<{TYPES[dtype]}>")((1,), (32,), (x, out))
    bits = float32_to_bf16(x) if dtype == "bfloat16" else x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(out, bits[0::2].astype(np.uint32) | bits[1::2].astype(np.uint32) << 16)


def test_mma_needs_the_whole_warp(module):
    """mma.sync.aligned is warp-collective: a block of 16 threads has no full warp, which the emulator
    reports instead of computing with missing fragments."""
    rng = np.random.default_rng(5)
    (a, _), (b, _) = random_16bit(rng, (16, 16), "float16"), random_16bit(rng, (16, 8), "float16")
    with pytest.raises(RuntimeError, match="mma.sync"):
        mma_kernel = module.get_function("mma_from_global<__half>")
        mma_kernel(
            (1,), (16,), (a, b, np.zeros((16, 8), np.float32), np.zeros((16, 8), np.float32), np.int32(0))
        )
