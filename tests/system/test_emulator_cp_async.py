"""The emulator's cp.async (cuda/common.cuh wrappers) against NumPy, and the mistakes it must expose.

A copy lands in shared memory only when the issuing thread's cp_async_wait releases its group; before
that the destination reads as NaN. So a double-buffered kernel is right under every fiber order, while
one that reads a stage before waiting for it, or waits for the wrong group, produces NaN.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends import emulator
from minisarathi.paths import cuda_dir

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)

SOURCE = Path(__file__).parents[1] / "kernels" / "cp_async_checks.cu"
VARIANTS = {  # name -> (bytes per chunk, zero-filled tail)
    "double_buffered_copy<16, false, NONE>": (16, True),
    "double_buffered_copy<16, true, NONE>": (16, False),
    "double_buffered_copy<8, true, NONE>": (8, False),
    "double_buffered_copy<4, true, NONE>": (4, False),
}
MISTAKES = ["double_buffered_copy<16, false, NO_WAIT>", "double_buffered_copy<16, false, WRONG_GROUP>"]
THREADS, BLOCKS = 64, 3


def kernel(name):
    names = [*VARIANTS, *MISTAKES, "exit_without_wait", "copy_to_global"]
    return emulator.load_module(SOURCE, names, (cuda_dir(),)).get_function(name)


def run_copy(name, chunk_bytes, n, out_len):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    out = np.full(out_len, 7.0, np.float32)
    kernel(name)((BLOCKS,), (THREADS,), (x, out, np.int32(n)), shared_mem=2 * THREADS * chunk_bytes)
    return x, out


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_double_buffered_copy_matches_numpy(name, order):
    chunk_bytes, zero_filled = VARIANTS[name]
    tile = THREADS * chunk_bytes // 4
    n = 7 * tile + 12  # 7 full tiles over 3 blocks, and a partial one
    out_len = 8 * tile if zero_filled else n
    with emulator.schedule(order, seed=3):
        x, out = run_copy(name, chunk_bytes, n, out_len)
    np.testing.assert_array_equal(out[:n], 2 * x)
    if zero_filled:  # chunks past n were zero-filled, not read
        np.testing.assert_array_equal(out[n:], 0.0)


@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("name", MISTAKES)
def test_reading_a_stage_before_its_wait_reads_poison(name, order):
    n = 7 * THREADS * 4
    with emulator.schedule(order):
        x, out = run_copy(name, 16, n, n)
    wrong = ~(out == 2 * x)
    assert np.isnan(out[: THREADS * 4]).all()  # the first tile read before it landed
    assert wrong.mean() > 0.5, wrong.mean()


def test_exit_with_copies_in_flight_is_an_error():
    with pytest.raises(RuntimeError, match="never waited for"):
        kernel("exit_without_wait")((1,), (32,), (np.zeros(128, np.float32),), shared_mem=512)


def test_destination_must_be_shared_memory():
    with pytest.raises(RuntimeError, match="not shared memory"):
        kernel("copy_to_global")((1,), (32,), (np.zeros(4, np.float32), np.zeros(4, np.float32)))
