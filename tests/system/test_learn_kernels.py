"""The learning path's kernels (cuda/learn) on the emulator against the reference backend, their compile
checks (NVRTC and nvcc, sm_80 and sm_90, no stack frame or spills in any instantiation), and the bench's dry
run.

Each step runs through bench.learn_kernels.attend, the launches the bench times on a GPU, over a paged cache
whose blocks are scattered, with contexts of one key, at and past block boundaries and past a tile; the
expected output is ReferenceOps.paged_attention on the same values in float32.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from nvrtc_build import ARCHITECTURES, build
from test_sass import _tool, local_memory_users, resources

from minisarathi.backends import emulator
from minisarathi.backends.reference import ReferenceOps
from minisarathi.dtypes import convert, to_float32
from minisarathi.paths import cuda_dir
from minisarathi.testing import scattered_batch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench.learn_kernels import STEPS, LearnKernels, attend, name_expressions  # noqa: E402

LEARN_FILES = sorted(STEPS.values())
TOLERANCE = {"float32": 2e-5, "float16": 1e-3, "bfloat16": 8e-3}  # relative to the output's scale
emulated_only = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)


@pytest.fixture(scope="module")
def kernels():
    return LearnKernels("cuda-emulated")


def check(kernels, step, dtype, Hq, Hk, D, block_size, runs, seed=0, **options):
    """runs: (cached tokens, new tokens) per sequence."""
    batch, num_blocks = scattered_batch(np.random.default_rng(seed), runs, block_size)
    state = np.random.RandomState(seed)
    q, k_cache, v_cache = (
        convert(state.standard_normal(shape).astype(np.float32), "float32", dtype)
        for shape in [(batch.num_tokens, Hq, D)] + 2 * [(num_blocks, Hk, block_size, D)]
    )
    out = attend(kernels, step, q, k_cache, v_cache, batch, 0.3, **options)
    expected = ReferenceOps().paged_attention(
        *(to_float32(x, dtype) for x in (q, k_cache, v_cache)), batch, 0.3
    )
    np.testing.assert_allclose(
        to_float32(out, dtype),
        expected,
        rtol=0,
        atol=TOLERANCE[dtype] * max(1.0, float(np.abs(expected).max())),
    )


DECODES = [(0, 1), (15, 1), (16, 1), (44, 1), (99, 1)]  # contexts 1, 16, 17 (block boundary), 45, 100


@emulated_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("step", ["01_naive", "02_online_softmax", "03_flash_decoding"])
def test_decode_steps_match_the_reference(kernels, step, dtype):
    # GQA 4 (two KV heads); step 3 in splits of 64 keys: the 100-key row merges two, the others write directly
    check(kernels, step, dtype, 8, 2, 64, 16, DECODES, partition_keys=64)


@emulated_only
def test_flash_decoding_merges_uneven_splits_under_reverse_order(kernels):
    with emulator.schedule("reverse"):
        check(
            kernels,
            "03_flash_decoding",
            "float16",
            4,
            4,
            32,
            8,
            [(0, 1), (31, 1), (32, 1), (96, 1)],
            seed=3,
            partition_keys=32,
        )


@emulated_only
@pytest.mark.parametrize("dtype, D, group", [("bfloat16", 64, 4), ("float16", 64, 1), ("bfloat16", 128, 2)])
def test_tensor_core_step_matches_the_reference(kernels, dtype, D, group):
    # Prefill chunks with and without history (one over two 64-row CTAs at group 4), next to decodes.
    runs = [(0, 20), (37, 9), (5, 1), (0, 1)] if D == 64 else [(10, 6), (0, 1)]
    check(kernels, "04_tensor_core", dtype, 2 * group, 2, D, 16, runs, seed=group)


@emulated_only
def test_decode_steps_refuse_query_runs(kernels):
    with pytest.raises(ValueError, match="decodes only"):
        check(kernels, "02_online_softmax", "float32", 2, 1, 32, 16, [(0, 3)])


# ---- compile checks: the kernels as a GPU would run them ---------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("file", LEARN_FILES)
def test_compiles_with_nvrtc_without_spills(file, arch):
    built = build(cuda_dir() / "learn" / file, arch, tuple(name_expressions(file)))
    assert "warning" not in built.log.lower(), built.log
    used = resources(built.log)
    assert set(built.lowered.values()) <= set(used)
    assert not local_memory_users(used), f"{file} ({arch}): {local_memory_users(used)}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("file", LEARN_FILES)
def test_compiles_with_nvcc_without_spills(file, arch):
    nvcc = _tool("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found (no CUDA toolkit)")
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = Path(tmp) / "all.cu"
        # Taking each kernel's address instantiates the templates, as NVRTC's name expressions do.
        wrapper.write_text(
            f'#include "{cuda_dir() / "learn" / file}"\n'
            + "".join(f"void* kernel_{i} = (void*)&{n};\n" for i, n in enumerate(name_expressions(file)))
        )
        built = subprocess.run(
            [
                nvcc,
                "--cubin",
                f"-arch={arch}",
                "-std=c++17",
                f"-I{cuda_dir()}",
                "-Xptxas",
                "-v,-warn-spills",
                "-o",
                str(Path(tmp) / "out.cubin"),
                str(wrapper),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    assert built.returncode == 0, built.stderr
    used = resources(built.stderr)
    assert len(used) >= len(name_expressions(file)) and not local_memory_users(used), (file, arch, used)


def test_every_learn_file_is_a_step():
    assert LEARN_FILES == sorted(p.name for p in (cuda_dir() / "learn").glob("*.cu"))


# ---- the bench ----------------------------------------------------------------------------------------


@emulated_only
def test_bench_dry_run_prints_a_line_per_kernel_and_shape():
    run = subprocess.run(
        [sys.executable, "-m", "bench.learn_kernels", "--device", "cuda-emulated"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [(r["kernel"], r["shape"]) for r in rows] == [(s, "decode") for s in STEPS] + [
        ("production", "decode"),
        ("04_tensor_core", "prefill"),
        ("production", "prefill"),
    ]
    assert all(r["ms"] > 0 for r in rows)
