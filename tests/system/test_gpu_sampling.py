"""sample_kernel with rows split over several CTAs (cuda/sampling.cu, minisarathi/backends/gpu_sampling.py):
the plan's choices, the kernel against a float64 reference of its rule under two fiber orders, edge cases
at the CTA boundaries, a negative control, and the emulator's blocks that wait for each other.

The NumPy-sampler equivalence and the statistical tests run through the split path too:
tests/unit/test_sampler.py (the `GpuSampler-emulated-split-rows` sampler) and
tests/system/test_cuda_backend.py (`rows-split-over-3-ctas`)."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends import cuda_ops, emulator
from minisarathi.backends.gpu_sampling import (
    MAX_CTAS_PER_ROW,
    SAMPLING,
    SPLIT_COST_TOKENS,
    sample_parameters,
    sample_plan,
)
from minisarathi.paths import cuda_dir
from minisarathi.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)
BLOCKS_WAIT = Path(__file__).parents[1] / "kernels" / "blocks_wait_checks.cu"


@pytest.fixture(params=["forward", "reverse"])
def order(request):
    with emulator.schedule(request.param, seed=1):
        yield request.param


def reference_sample(logits, temperature, top_k, top_p, min_p, u) -> int:
    """float64 reference of sample_kernel's rule: min-p, top-k, top-p on weights exp((x - max) / t) (ties at a
    cut all kept), then an inverse CDF in token order; token 0 when nothing is kept."""
    if temperature <= 0:
        return int(np.argmax(logits))
    if np.isneginf(logits).all():
        return 0
    w = np.exp((logits.astype(np.float64) - logits.max()) / temperature)
    keep = (w >= min_p) & (w > 0)
    if 0 < top_k < len(w):
        keep &= w >= np.sort(w[keep])[::-1][min(top_k, keep.sum()) - 1]
    if top_p < 1:
        order = np.argsort(-w, kind="stable")
        mass = np.cumsum(w[order] * keep[order])
        keep &= w >= w[order][np.searchsorted(mass, top_p * mass[-1])]
    cdf = np.cumsum(np.where(keep, w, 0))
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


# ---- the plan ------------------------------------------------------------------------------------------


def test_plan_keeps_short_rows_whole_and_splits_long_ones():
    """A split costs SPLIT_COST_TOKENS of work on top of the chunk, more than 7/8 of any row that fits one
    CTA: so a row stays in one CTA exactly when it fits in its shared memory (SAMPLE_MAX_CHUNK, 36864 tokens),
    and longer rows split as the cost model says; a full batch keeps rows as whole as shared memory allows."""
    longest_whole = SAMPLING["SAMPLE_MAX_CHUNK"]
    assert (
        longest_whole == 36864
        and longest_whole * (MAX_CTAS_PER_ROW - 1) / MAX_CTAS_PER_ROW < SPLIT_COST_TOKENS
    )
    for rows in (1, 64, 132, 1000):
        assert sample_plan(rows, longest_whole, 132).ctas_per_row == 1
    assert sample_plan(1, longest_whole + 4, 132).ctas_per_row == MAX_CTAS_PER_ROW
    assert (
        sample_plan(132, longest_whole + 4, 132).ctas_per_row == 2
    )  # the fewest that fit: one more iteration
    assert sample_plan(11, 384, 132).ctas_per_row == 1
    # The target shape: batch 64 x 128k on 132 SMs: 4 CTAs per row (the fewest that fit in shared memory),
    # 33 groups in two iterations, one CTA per SM.
    plan = sample_plan(64, 128256, 132)
    assert (plan.ctas_per_row, plan.groups, plan.chunk, plan.threads, plan.shared_bytes) == (
        4,
        33,
        32064,
        1024,
        128256,
    )
    assert sample_plan(1, 128256, 132).ctas_per_row == 8


@pytest.mark.parametrize(
    "rows, vocab, sms",
    [(1, 7, 132), (64, 128256, 132), (300, 151936, 108), (5, 32000, 16), (1000, 50, 132), (3, 262144, 132)],
)
def test_plan_covers_every_token_once_within_the_resident_grid(rows, vocab, sms):
    plan = sample_plan(rows, vocab, sms)
    assert plan.grid <= sms  # every CTA of a row resident at once
    assert plan.chunk % 4 == 0 and plan.chunk <= SAMPLING["SAMPLE_MAX_CHUNK"]
    assert (plan.ctas_per_row - 1) * plan.chunk < vocab <= plan.ctas_per_row * plan.chunk
    assert plan.threads % 32 == 0 and 32 <= plan.threads <= SAMPLING["SAMPLE_THREADS"]


def test_plan_rejects_impossible_splits():
    with pytest.raises(ValueError, match="ctas_per_row"):
        sample_plan(4, 128256, 132, ctas_per_row=2)  # a chunk would not fit in shared memory
    with pytest.raises(ValueError, match="ctas_per_row"):
        sample_plan(4, 1000, 132, ctas_per_row=133)
    with pytest.raises(ValueError, match="vocab"):
        sample_plan(4, SAMPLING["SAMPLE_MAX_CHUNK"] * 133, 132)


# ---- the kernel with split rows ------------------------------------------------------------------------

PARAMS = [  # temperature, top_k, top_p, min_p: every filter alone and together, rows differing in one batch
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.9, 20, 0.5, 0.05),
    (1.0, 1, 1.0, 0.0),
    (2.0, 400, 0.99, 0.0),
    (1.0, 50, 0.6, 0.3),
    (0.8, 50, 0.9, 0.0),
    (1.0, 3, 1.0, 0.0),
    (1.0, 10**6, 1.0, 0.0),
    (0.6, 0, 1e-6, 0.0),
    (1.0, 2, 0.7, 0.0),
]


def split_case(vocab: int, seed: int):
    """Logits [len(PARAMS) + 3, vocab] with ties and -inf placed across the CTAs' chunks."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((len(PARAMS) + 3, vocab)) * 2).astype(np.float32)
    spread = [0, vocab // 3, vocab // 2, 2 * vocab // 3, vocab - 1]
    logits[10, spread] = (
        logits[10].max() + 1
    )  # 5 tokens tie for the top, in different chunks: top-k 3 keeps all
    logits[0, [vocab - 1, vocab // 2]] = 60.0  # a greedy tie across chunks: the lowest id wins
    logits[13, spread[1:3]] = logits[13].max() + 1  # top-k 2 cut exactly at a tie, top-p inside it
    logits[-3] = -np.inf  # only three tokens left, in different chunks
    logits[-3, spread[1:4]] = [1.0, 3.0, 2.0]
    logits[-2, :] = 0.5  # a flat row: every token ties
    logits[-1] = -np.inf  # nothing at all: token 0
    params = PARAMS + [(1.0, 2, 0.9, 0.0), (1.0, 7, 0.5, 0.0), (1.0, 0, 1.0, 0.0)]
    return logits, params


@pytest.mark.parametrize("vocab, ctas", [(301, 3), (1000, 2), (1000, 7), (9, 4)])
def test_split_rows_match_the_float64_reference(order, vocab, ctas):
    """Odd vocabularies take 4-byte copies, multiples of 4 the 16-byte ones; 9 tokens over 4 CTAs leaves
    the last one an empty chunk."""
    ops = cuda_ops.emulated()
    logits, params = split_case(vocab, seed=vocab + ctas)
    rng = np.random.default_rng(ctas)
    for u in [
        rng.uniform(size=len(params)),
        np.zeros(len(params)),
        np.full(len(params), np.nextafter(1.0, 0)),
    ]:
        ids = ops.sample(logits, *zip(*params), u, ctas_per_row=ctas)
        expected = [reference_sample(logits[r], *params[r], float(u[r])) for r in range(len(params))]
        np.testing.assert_array_equal(ids, expected)
    one_cta = ops.sample(logits, *zip(*params), u, ctas_per_row=1)
    np.testing.assert_array_equal(ids, one_cta)  # the split changes nothing, ties and extremes included


def test_draws_reach_every_tied_token_across_chunks():
    """Top-k 3 with 5 tokens tied for the top, one per chunk: uniform draws reach all 5 in equal shares."""
    ops, vocab, n = cuda_ops.emulated(), 1000, 500
    logits = np.zeros((n, vocab), np.float32)
    logits[:, [0, 333, 500, 666, 999]] = 4.0
    u = (np.arange(n) + 0.5) / n
    ids = ops.sample(logits, [1.0] * n, [3] * n, [1.0] * n, [0.0] * n, u, ctas_per_row=3)
    assert np.bincount(ids, minlength=vocab)[[0, 333, 500, 666, 999]].tolist() == [100] * 5


def test_negative_control_a_merge_without_its_barrier_is_caught(monkeypatch):
    """The same kernel with the row barrier defeated (arrival counters preset, so no CTA waits) and the
    blocks run one after another: each CTA merges its own histogram with the zeros of CTAs that have not run.
    The comparison above must then fail."""
    ops, vocab, ctas = cuda_ops.emulated(), 1000, 3
    logits, params = split_case(vocab, seed=5)
    rows, u = len(params), np.random.default_rng(5).uniform(size=len(params))
    plan = sample_plan(rows, vocab, ops.launcher.multiprocessors, ctas)
    workspace = np.zeros(plan.workspace_words, np.uint64)
    workspace[: plan.groups] = 1 << 40  # every barrier already passed
    packed = sample_parameters(*zip(*params), u, vocab)
    ids = np.full(rows, -1, np.int32)
    monkeypatch.setenv("MINISARATHI_EMU_THREADS", "1")
    kernel = ops.launcher.kernel("sampling.cu", "sample_kernel")
    kernel(
        (plan.grid,),
        (plan.threads,),
        (
            logits,
            np.int32(rows),
            np.int32(vocab),
            packed,
            np.int32(ctas),
            np.int32(plan.chunk),
            workspace,
            ids,
        ),
        shared_mem=plan.shared_bytes,
    )
    expected = [reference_sample(logits[r], *params[r], float(u[r])) for r in range(rows)]
    assert (ids != expected).sum() >= 3


# ---- launching on a GPU: shared memory opt-in and cooperative launch -------------------------------------


# sample_kernel's static scratch (~17 KiB) plus its chunk above 48 KiB needs the opt-in, though the chunk
# alone may be under it: vocabularies of about 8k-12k at any batch, and 64k-98k split 8 ways at small batches.
@pytest.mark.needs_nvrtc
@pytest.mark.parametrize(
    "rows, vocab", [(3, 8192), (2, 10007), (1, 12288), (2, 65024), (1, 65536), (1, 92544)]
)
def test_sample_opts_in_to_static_plus_dynamic_shared_memory_over_48_kib(rows, vocab):
    ops = cuda_ops.emulated()
    static = ops.launcher.kernel("sampling.cu", "sample_kernel").attributes["shared_size_bytes"]
    plan = sample_plan(rows, vocab, ops.launcher.multiprocessors)
    assert plan.shared_bytes <= 48 * 1024 < plan.shared_bytes + static  # refused on a GPU without the opt-in
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    params = [(1.0, 0, 1.0, 0.0), (0.8, 40, 0.9, 0.0), (1.2, 0, 0.7, 0.05)][:rows]
    u = rng.uniform(size=rows)
    ids = ops.sample(logits, *zip(*params), u)
    assert ids.tolist() == [reference_sample(logits[r], *params[r], float(u[r])) for r in range(rows)]


def test_sample_sets_the_shared_memory_attribute_once_not_every_step(monkeypatch):
    """cuFuncSetAttribute is a driver call: the opt-in is made at the first step that needs it, then
    cached."""
    sets = []
    attribute = emulator.EmulatedKernel.max_dynamic_shared_size_bytes
    monkeypatch.setattr(
        emulator.EmulatedKernel,
        "max_dynamic_shared_size_bytes",
        property(attribute.fget, lambda kernel, n: sets.append(kernel.name) or attribute.fset(kernel, n)),
    )
    sampler = cuda_ops.emulated().new_sampler(20000)  # 80 KB of logits per CTA: over 48 KiB even alone
    logits = np.random.default_rng(0).standard_normal((2, 20000)).astype(np.float32)
    for _ in range(4):
        sampler.sample(logits, [SamplingParams(temperature=1.0)] * 2, [None] * 2, [[1]] * 2, [[]] * 2)
    assert sets == ["sample_kernel"]


def test_sampling_module_launches_cooperatively_on_both_launchers(monkeypatch):
    """sample_kernel's CTAs wait for each other: CuPy must use cuLaunchCooperativeKernel for it, so that a
    grid the GPU cannot hold at once (MPS, green contexts) fails to launch instead of hanging."""
    built = {}

    class FakeRawModule:
        def __init__(self, code, options, name_expressions, enable_cooperative_groups=False):
            self.cooperative = enable_cooperative_groups

        def get_function(self, name):
            return self

    class FakeCupy:
        RawModule = FakeRawModule

    launcher = object.__new__(cuda_ops.CupyLauncher)  # no GPU here: only kernel() is exercised
    launcher.xp, launcher._modules, launcher._kernels = FakeCupy, {}, {}
    for file in cuda_ops.kernel_files():
        for name in cuda_ops.name_expressions(file):
            built[name] = launcher.kernel(file, name).cooperative
    # Only sample_kernel: CuPy would cut a cooperative argmax grid of more rows than fit at once, silently.
    assert {name for name, cooperative in built.items() if cooperative} == {"sample_kernel"}
    emulated = cuda_ops.emulated().launcher
    assert emulated.kernel("sampling.cu", "sample_kernel").cooperative
    assert not emulated.kernel("sampling.cu", "argmax_kernel").cooperative


@pytest.mark.needs_nvrtc
def test_sample_kernel_grid_beyond_what_the_gpu_holds_is_refused():
    """A cooperative launch of more CTAs than are co-resident (here 1 per SM: 100 KiB of shared memory each)
    is refused before it runs, as cuLaunchCooperativeKernel refuses it."""
    kernel = cuda_ops.emulated().launcher.kernel("sampling.cu", "sample_kernel")
    kernel.max_dynamic_shared_size_bytes = max(kernel.max_dynamic_shared_size_bytes, 100 * 1024)
    args = (
        np.zeros((133, 4), np.float32),
        np.int32(133),
        np.int32(4),
        np.zeros((5, 133)),
        np.int32(1),
        np.int32(4),
        np.zeros(133, np.uint64),
        np.zeros(133, np.int32),
    )
    with pytest.raises(
        ValueError, match=r"cooperative launch of grid \(133, 1, 1\) is more than the 132 blocks"
    ):
        kernel((133,), (1024,), args, shared_mem=100 * 1024)


# ---- the emulator: blocks that wait for each other ----------------------------------------------------


def blocks_wait_kernel(cooperative: bool = True):
    return emulator.load_module(
        BLOCKS_WAIT, ["sum_after_grid_barrier"], (cuda_dir(),), enable_cooperative_groups=cooperative
    ).get_function("sum_after_grid_barrier")


def test_blocks_waiting_for_each_other_all_run():
    """40 blocks meet at one barrier on the emulator's few threads: blocks that wait start the others."""
    kernel = blocks_wait_kernel()
    for order in ("forward", "reverse"):
        with emulator.schedule(order):
            published, sums = np.zeros(40, np.int32), np.zeros(40, np.int32)
            kernel((40,), (64,), (np.zeros(1, np.uint64), published, sums))
            assert sums.tolist() == [40 * 41 // 2] * 40


def test_blocks_waiting_for_each_other_need_a_cooperative_launch():
    """Only a cooperative launch guarantees that every block is resident; a plain launch may deadlock."""
    with pytest.raises(RuntimeError, match="waits for other blocks, but the launch is not cooperative"):
        blocks_wait_kernel(cooperative=False)(
            (2,), (32,), (np.zeros(1, np.uint64), np.zeros(2, np.int32), np.zeros(2, np.int32))
        )


def test_cooperative_grid_beyond_the_resident_blocks_is_refused():
    """64-thread blocks: 32 per SM (the block limit), 4224 on 132 SMs; on an A100's 108 SMs, 3456."""
    kernel = blocks_wait_kernel()
    grid = 32 * 132 + 1
    with pytest.raises(ValueError, match="more than the 4224 blocks the H100/H200"):
        kernel((grid,), (64,), (np.zeros(1, np.uint64), np.zeros(grid, np.int32), np.zeros(grid, np.int32)))
    a100 = emulator.load_module(
        BLOCKS_WAIT,
        ["sum_after_grid_barrier"],
        (cuda_dir(),),
        enable_cooperative_groups=True,
        device=emulator.A100,
    ).get_function("sum_after_grid_barrier")
    grid = 32 * 108 + 1
    with pytest.raises(ValueError, match="more than the 3456 blocks the A100"):
        a100((grid,), (64,), (np.zeros(1, np.uint64), np.zeros(grid, np.int32), np.zeros(grid, np.int32)))
