"""The CUDA backend's first run on a GPU, as one conclusive run: correctness first (every op of CudaOps, the
samplers and whole models against the CPU backend, eager), then decode steps as CUDA graphs and overlap
against eager, then speed against measured ceilings. One process per section with its own limit
(bench/gpu_runner.py); the summary says what the engine would serve with given what failed.

    bash bench/gpu_check.sh [--quick]                      # on the GPU machine: results under $OUT
    python3 bench/gpu_check.py --out DIR [--quick] [--section NAME ...]
    python3 bench/gpu_check.py --device cuda-emulated --quick   # a dry run on the CPU emulator, no speed
    python3 bench/gpu_check.py --list                      # sections, order, limits
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gpu_runner import CPU, Section, exit_code, run_sections  # noqa: E402
from minisarathi import structured  # noqa: E402
from minisarathi.backends import cuda_ops  # noqa: E402
from minisarathi.backends.cpu.ops import CpuOps  # noqa: E402
from minisarathi.config import rope_cos_sin_table  # noqa: E402
from minisarathi.dtypes import bf16_to_float32, float32_to_bf16  # noqa: E402
from minisarathi.paths import default_model_dir  # noqa: E402
from minisarathi.sampler import Sampler, make_generator  # noqa: E402
from minisarathi.sampling_params import SamplingParams  # noqa: E402
from minisarathi.testing import ScheduledChunk, build_batch, scattered_batch  # noqa: E402

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")  # "cuda-emulated": the checks on the CPU emulator
# gpu_check.sh's outer limits: 500 and 285 s (tests/system/test_gpu_check.py)
BUDGET_S = {"full": 480, "quick": 270}
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 3e-2}
INSTALL_HINT = (
    "pip install cupy-cuda13x 'cuda-toolkit[nvrtc,cudart,cublas]==13.0.*' (CUDA 13 driver) or "
    "cupy-cuda12x nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cublas-cu12 (CUDA 12)"
)
LARGE_VOCAB = 92544  # InternLM2's: vocabularies of 64k-98k need the shared-memory opt-in at batch <= 17
PROMPT = [1, 403, 407, 261, 378]


# ---- helpers -------------------------------------------------------------------------------------------


def make_ops(dtype: str):
    return cuda_ops.emulated(dtype) if DEVICE == "cuda-emulated" else cuda_ops.gpu(dtype)


def host(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to dtype, as float32 (what the GPU sees)."""
    if dtype == "bfloat16":
        return bf16_to_float32(float32_to_bf16(x))
    return x.astype(dtype).astype(np.float32)


def random_host(rng, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    return host((rng.standard_normal(shape) * scale).astype(np.float32), dtype)


def compare(report, name: str, ops, got, want: np.ndarray, dtype: str) -> None:
    """A row: max error relative to max(1, |want|), within the dtype's tolerance (NaN fails)."""
    got = ops.to_numpy(got)
    error = float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))
    report.row(name, "ok" if error <= TOLERANCE[dtype] else "MISMATCH", f"max error {error:.2e} of scale")


def timed(fn, repeat: int = 20) -> float:
    """Median seconds of fn() on the GPU between CUDA events on the current stream, after a warm-up."""
    import cupy

    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


def random_device(ops, shape, scale=1.0):
    """Random values made on the GPU in the activation dtype (fast even for an 8B shape)."""
    import cupy

    x = cupy.random.standard_normal(shape, dtype=cupy.float32)
    x *= np.float32(scale)
    return cuda_ops.convert(x, "float32", ops.dtype)


# ---- environment ---------------------------------------------------------------------------------------


def check_environment(report) -> None:
    if DEVICE == "cuda-emulated":
        report.row(
            "device", "ok", "cuda-emulated: the CUDA kernels on the CPU emulator (a dry run, no speed)"
        )
        return
    try:
        import cupy
    except ImportError as exc:
        report.row("environment", "MISSING", f"CuPy is not importable ({exc}); {INSTALL_HINT}")
        return
    start = time.perf_counter()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver: CUDARuntimeError
        report.row(
            "environment",
            "MISSING",
            f"no CUDA GPU usable by CuPy {cupy.__version__}: {str(exc).splitlines()[0][:120]}",
        )
        return
    if not count:
        report.row("environment", "MISSING", f"no CUDA GPU visible to CuPy {cupy.__version__}")
        return
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    free, total = cupy.cuda.runtime.memGetInfo()  # creates the context: every section's process pays this
    start_up = time.perf_counter() - start
    report.data = {
        "name": name,
        "arch": f"sm_{props['major']}{props['minor']}",
        "sms": props["multiProcessorCount"],
        "shared_per_block_optin": props.get("sharedMemPerBlockOptin"),
        "gpus": count,
    }
    report.row(
        "device",
        "ok",
        f"{name}, sm_{props['major']}{props['minor']}, {props['multiProcessorCount']} SMs, "
        f"{free / 2**30:.0f} of {total / 2**30:.0f} GiB free, "
        f"{props.get('sharedMemPerBlockOptin', 0) // 1024} KiB shared per block (opt-in); "
        f"CUDA context made in {start_up:.1f} s",
    )
    nvrtc = cupy.cuda.nvrtc.getVersion()
    report.row(
        "versions",
        "ok",
        f"CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
        f"driver {cupy.cuda.runtime.driverGetVersion()}, NVRTC {nvrtc[0]}.{nvrtc[1]}, "
        f"NumPy {np.__version__}, {count} GPU(s)",
    )


# ---- correctness: compile, ops, samplers, models (eager) ---------------------------------------------------


def compile_kernels(report) -> None:
    """Every kernel file through NVRTC (CuPy's disk cache then serves the later sections), and each kernel's
    registers, static shared memory and local memory (stack frame and spills) from cuFuncGetAttribute."""
    launcher = make_ops("float32").launcher
    resources = {}
    for file in cuda_ops.kernel_files():
        start = time.perf_counter()
        kernels = report.check(
            f"compile {file}",
            lambda f=file: {name: launcher.kernel(f, name) for name in cuda_ops.name_expressions(f)},
        )
        if kernels is None:
            continue
        report.row(f"compile {file}", "ok", f"{len(kernels)} kernels, {time.perf_counter() - start:.1f} s")
        for name, kernel in kernels.items():
            a = getattr(kernel, "attributes", {})  # a CuPy RawKernel's (the emulator's know fewer)
            if "num_regs" in a and "local_size_bytes" in a:
                resources[name] = {
                    k: a[k]
                    for k in ("num_regs", "shared_size_bytes", "local_size_bytes", "max_threads_per_block")
                }
    report.data["resources"] = resources
    for name, r in resources.items():
        print(
            f"    {name:60s} regs {r['num_regs']:3d}  static smem {r['shared_size_bytes']:6d} B  "
            f"local {r['local_size_bytes']:4d} B  max threads {r['max_threads_per_block']}"
        )
    if resources:
        regs = max(resources, key=lambda n: resources[n]["num_regs"])
        smem = max(resources, key=lambda n: resources[n]["shared_size_bytes"])
        local = [f"{n} ({r['local_size_bytes']} B)" for n, r in resources.items() if r["local_size_bytes"]]
        report.row(
            "kernel resources",
            "ok" if not local else "local memory",
            f"{len(resources)} kernels; most registers {resources[regs]['num_regs']} ({regs}); most static "
            f"smem {resources[smem]['shared_size_bytes']} B ({smem}); stack/spills: "
            f"{', '.join(local) or 'none'}",
        )


# CudaOps methods that only place or move data: the models exercise them. Every other public method is an op
# that check_ops or check_sampling compares with the CPU backend; a new one shows up as not checked.
PLACEMENT = {
    "weight",
    "linear_weight",
    "zeros",
    "constant",
    "to_numpy",
    "free_memory_bytes",
    "new_sampler",
    "upload_batch",
}
CHECKED_OPS = {
    "embedding",
    "rms_norm",
    "add_rms_norm",
    "linear",
    "rope_store_kv",
    "paged_attention",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "softcap",
    "copy_blocks",
    "greedy",
    "apply_penalties",
    "sample",
    "apply_token_bitmask",
}


def check_ops(report, dtype: str) -> None:
    """Each op of CudaOps in `dtype` against CpuOps (float32) on inputs rounded to `dtype`."""
    rng, ops, ref = np.random.default_rng(0), make_ops(dtype), CpuOps()
    methods = {
        m for m in dir(cuda_ops.CudaOps) if not m.startswith("_") and callable(getattr(cuda_ops.CudaOps, m))
    }
    unchecked = sorted(methods - PLACEMENT - CHECKED_OPS)
    report.row(
        f"ops {dtype} covered",
        "ok" if not unchecked else "unchecked",
        f"{len(methods & CHECKED_OPS)} ops; not checked: {', '.join(unchecked) or 'none'}",
    )

    def elementwise():
        x32, w32, r32 = (random_host(rng, s, dtype) for s in [(9, 1000), (1000,), (9, 1000)])
        x, w, r = ops.weight(x32), ops.weight(w32), ops.weight(r32)
        compare(
            report,
            f"ops {dtype} rms_norm",
            ops,
            ops.rms_norm(x, w, 1e-5),
            ref.rms_norm(x32, w32, 1e-5),
            dtype,
        )
        out, residual = ops.add_rms_norm(x, r, w, 1e-5)
        want, want_residual = ref.add_rms_norm(x32, r32.copy(), w32, 1e-5)
        compare(report, f"ops {dtype} add_rms_norm", ops, out, want, dtype)
        compare(
            report, f"ops {dtype} add_rms_norm residual", ops, residual, host(want_residual, dtype), dtype
        )
        compare(report, f"ops {dtype} silu_and_mul", ops, ops.silu_and_mul(x), ref.silu_and_mul(x32), dtype)
        want_gelu = ref.gelu_tanh_and_mul(x32)
        compare(report, f"ops {dtype} gelu_tanh_and_mul", ops, ops.gelu_tanh_and_mul(x), want_gelu, dtype)
        logits32 = random_host(rng, (9, 1000), dtype, 20.0)  # past the cap, where tanh bends
        want_capped = ref.softcap(logits32, 8.0)
        capped = ops.softcap(ops.weight(logits32), 8.0)
        compare(report, f"ops {dtype} softcap", ops, capped, want_capped, dtype)
        table32, ids = random_host(rng, (1000, 64), dtype), np.array([0, 5, 999, 5], np.int32)
        compare(
            report,
            f"ops {dtype} embedding",
            ops,
            ops.embedding(ops.weight(table32), ids),
            table32[ids],
            dtype,
        )

    def linear():
        for T, N, K in [(9, 300, 1000), (1, 4096, 64), (64, 1000, 257)]:
            x32, w32, b32 = (
                random_host(rng, (T, K), dtype),
                random_host(rng, (N, K), dtype, K**-0.5),
                random_host(rng, (N,), dtype),
            )
            x, w = ops.weight(x32), ops.linear_weight(ops.weight(w32))
            compare(report, f"ops {dtype} linear {T}x{N}x{K}", ops, ops.linear(x, w), x32 @ w32.T, dtype)
            compare(
                report,
                f"ops {dtype} linear+bias {T}x{N}x{K}",
                ops,
                ops.linear(x, w, ops.weight(b32)),
                x32 @ w32.T + b32,
                dtype,
            )

    def rope_store_kv():
        T, Hq, Hk, D, bs = 7, 32, 8, 128, 16
        qkv32 = random_host(rng, (T, (Hq + 2 * Hk) * D), dtype)
        positions = np.array([0, 1, 2, 3, 100, 5000, 130000], np.int32)
        slots = np.array([5, 17, -1, 40, 3, 63, 22], np.int32)
        cos_sin = rope_cos_sin_table((1.0 / 500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32), 130001)

        def split(a):
            return (
                a[:, : Hq * D].reshape(T, Hq, D),
                a[:, Hq * D : (Hq + Hk) * D].reshape(T, Hk, D),
                a[:, (Hq + Hk) * D :].reshape(T, Hk, D),
            )

        qkv, k_cache, v_cache = ops.weight(qkv32), ops.zeros((4, Hk, bs, D)), ops.zeros((4, Hk, bs, D))
        ops.rope_store_kv(*split(qkv), k_cache, v_cache, positions, slots, ops.constant(cos_sin))
        want, k_ref, v_ref = (
            qkv32.copy(),
            np.zeros((4, Hk, bs, D), np.float32),
            np.zeros((4, Hk, bs, D), np.float32),
        )
        ref.rope_store_kv(*split(want), k_ref, v_ref, positions, slots, cos_sin)
        # Rotated values are rounded to the dtype once more on the GPU: compare after rounding the reference
        # too.
        compare(
            report,
            f"ops {dtype} rope_store_kv q (strided)",
            ops,
            qkv[:, : Hq * D],
            host(want[:, : Hq * D], dtype),
            dtype,
        )
        compare(report, f"ops {dtype} rope_store_kv k cache", ops, k_cache, host(k_ref, dtype), dtype)
        compare(report, f"ops {dtype} rope_store_kv v cache", ops, v_cache, v_ref, dtype)
        sources, destinations = [0, 2], [3, 1]
        ops.copy_blocks([(k_cache, v_cache)], sources, destinations)
        ref.copy_blocks([(k_ref, v_ref)], sources, destinations)
        compare(report, f"ops {dtype} copy_blocks", ops, k_cache, host(k_ref, dtype), dtype)

    # (cached tokens, new tokens) per sequence: decodes, prefill chunks (the tensor-core kernel in 16 bits),
    # and both in one batch, over Llama-3's heads (GQA 4, head_dim 128) and a GQA-8 head_dim-64 shape.
    long = 4000 if report.quick or DEVICE == "cuda-emulated" else 20000
    cases = [
        ("mixed", [(0, 1), (0, 37), (15, 1), (16, 1), (40, 9), (3000, 1)], 32, 8, 128),
        ("long decode", [(4095, 1)] * 8 + [(long, 1)], 32, 8, 128),
        ("prefill chunks", [(0, 130), (200, 64), (700, 17)], 32, 8, 128),
        ("prefill GQA 8 D 64", [(100, 70), (0, 1), (33, 1)], 16, 2, 64),
    ]

    def attention(runs, Hq, Hk, D):
        batch, blocks = scattered_batch(rng, runs, 16)
        k32, v32 = (random_host(rng, (blocks, Hk, 16, D), dtype) for _ in range(2))
        q32 = random_host(rng, (batch.num_tokens, Hq, D), dtype)
        got = ops.paged_attention(ops.weight(q32), ops.weight(k32), ops.weight(v32), batch, D**-0.5)
        return got, ref.paged_attention(q32, k32, v32, batch, D**-0.5)

    report.check(f"ops {dtype} elementwise", elementwise)
    report.check(f"ops {dtype} linear", linear)
    report.check(f"ops {dtype} rope_store_kv", rope_store_kv)
    for label, runs, Hq, Hk, D in cases:
        result = report.check(f"ops {dtype} attention {label}", attention, runs, Hq, Hk, D)
        if result is not None:
            compare(report, f"ops {dtype} attention {label}", ops, *result, dtype)


class FixedDraw:
    """A request's generator that always draws u: the NumPy Sampler then uses the uniforms given to the
    kernel."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


def check_sampling(report) -> None:
    """greedy, apply_penalties and sample (through GpuSampler) against the NumPy Sampler, over vocabularies
    whose shared memory needs the opt-in (10,007: 8k-12k at any batch; 65,024 and 92,544 at batch <= 17)."""
    ops, rng = make_ops("float32"), np.random.default_rng(2)
    N, V = (16, 32000) if report.quick or DEVICE == "cuda-emulated" else (64, 128256)
    logits = (rng.standard_normal((N, V)) * 2).astype(np.float32)
    logits[1, [10, V - 7]] = 50.0  # a tie: the lowest id wins
    device_logits = ops.launcher.to_device(logits)

    def argmax():
        same = np.array_equal(ops.launcher.to_host(ops.greedy(device_logits)), logits.argmax(1))
        report.row(
            "sampling greedy argmax", "ok" if same else "MISMATCH", f"{N} x {V}, ties to the lowest id"
        )

    def every_kind():
        kinds = [
            dict(temperature=0),
            dict(temperature=1.0),
            dict(temperature=0.7, top_k=50),
            dict(temperature=1.0, top_p=0.9),
            dict(temperature=1.0, min_p=0.1),
            dict(temperature=0.8, top_k=40, top_p=0.8, min_p=0.02, seed=5),
            dict(
                temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5, logprobs=5
            ),
            dict(temperature=1.0, seed=9, logprobs=3, min_tokens=3, stop_token_ids=[7]),
        ]
        params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(N)]
        prompts = [rng.integers(0, V, 50).tolist() for _ in range(N)]
        outputs = [rng.integers(0, V, 2).tolist() for _ in range(N)]

        def generators():
            return [None if p.seed is None else make_generator(p.seed) for p in params]

        want = Sampler(V, 0, (2,)).sample(logits, params, generators(), prompts, outputs)
        got = ops.new_sampler(V, 0, (2,)).sample(device_logits, params, generators(), prompts, outputs)
        greedy = np.array([p.temperature == 0 for p in params])
        same = got.token_ids == want.token_ids
        rows = [i for i, w in enumerate(want.logprobs) if w is not None and same[i]]
        same_ids = all([t for t, _ in got.logprobs[i]] == [t for t, _ in want.logprobs[i]] for i in rows)
        error = max(
            (abs(g[1] - w[1]) for i in rows for g, w in zip(got.logprobs[i], want.logprobs[i])), default=0.0
        )
        # Sampled rows may rarely differ where float32 (GPU) and float64 (NumPy) CDFs straddle the uniform.
        ok = same[greedy].all() and same[~greedy].mean() >= 0.9 and same_ids and error <= 1e-4
        report.row(
            f"sampling GpuSampler {N}x{V}",
            "ok" if ok else "MISMATCH",
            f"greedy {same[greedy].sum()}/{greedy.sum()}, sampled {same[~greedy].sum()}/{(~greedy).sum()} "
            f"same ids; logprob ids {'same' if same_ids else 'differ'}, error {error:.1e}",
        )

    def top_k_top_p(rows: int, vocab: int):
        x = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
        u = rng.uniform(size=rows)
        params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * rows
        want = (
            Sampler(vocab).sample(x, params, [FixedDraw(v) for v in u], [[1]] * rows, [[]] * rows).token_ids
        )
        got = ops.launcher.to_host(
            ops.sample(
                ops.launcher.to_device(x),
                np.ones(rows),
                np.full(rows, 50),
                np.full(rows, 0.9),
                np.zeros(rows),
                u,
            )
        )
        same = int((got == want).sum())
        report.row(
            f"sampling sample top-k 50 top-p 0.9 {rows}x{vocab}",
            "ok" if same >= rows - max(1, rows // 30) else "MISMATCH",
            f"{same}/{rows} same ids as the NumPy Sampler",
        )

    def token_bitmask():
        rows = np.array([1, 3, N - 1], np.int64)
        bitmask = rng.integers(0, 2**32, (len(rows), -(-V // 32)), dtype=np.uint32)  # uint32[R, ceil(V / 32)]
        masked = ops.launcher.to_device(logits)
        ops.apply_token_bitmask(masked, ops.launcher.to_device(rows), ops.launcher.to_device(bitmask))
        want = structured.apply_token_bitmask(logits, rows, bitmask.view(np.int32))
        same = np.array_equal(ops.launcher.to_host(masked), want)
        report.row("sampling apply_token_bitmask", "ok" if same else "MISMATCH", f"{len(rows)} of {N} rows")

    report.check("sampling greedy argmax", argmax)
    report.check("sampling apply_token_bitmask", token_bitmask)
    report.check(f"sampling GpuSampler {N}x{V}", every_kind)
    shapes = [
        (1, 10007),
        (64, 10007),
        (1, 65024),
        (1, LARGE_VOCAB),
        (17, 65024),
        (17, LARGE_VOCAB),
        (64, 128256),
    ]
    for rows, vocab in shapes[:4] if report.quick else shapes:
        report.check(f"sampling sample {rows}x{vocab}", top_k_top_p, rows, vocab)


def build_model(path: Path, ops):
    from minisarathi.config import ModelConfig
    from minisarathi.model.llama import LlamaModel
    from minisarathi.model.loader import load_weights

    config = ModelConfig.from_pretrained(path)
    return LlamaModel(config, load_weights(path, config), ops)


def large_vocab_model(scratch: Path) -> Path:
    """A random Llama (GQA 4, head_dim 64, 2 layers) with a 92,544-token vocabulary, written once per run."""
    from minisarathi.bench.random_model import write_random_model

    folder = scratch / f"random-{LARGE_VOCAB}"
    if not folder.exists():
        partial = write_random_model(
            scratch / f"partial-{os.getpid()}",
            hidden_size=256,
            num_layers=2,
            num_heads=4,
            num_kv_heads=1,
            intermediate_size=688,
            vocab_size=LARGE_VOCAB,
        )
        partial.rename(folder)
    return folder


def generate(model, prompt: list[int], new_tokens: int, on_device: bool = False, block_size: int = 16):
    """(greedy tokens, logits of every prompt row and step): by a host argmax of the logits, or, on_device,
    through forward(device_logits=True) and the model's own sampler as the engine runs (logits None)."""
    table = list(range(-(-(len(prompt) + new_tokens) // block_size)))
    cache = model.new_kv_cache(len(table), block_size)
    sampler, greedy = model.new_sampler() if on_device else None, SamplingParams(temperature=0)
    ids, chunk, logits = list(prompt), ScheduledChunk(prompt, 0, table, True), []
    while len(ids) < len(prompt) + new_tokens:
        batch = build_batch([chunk], block_size)
        if on_device:
            step = model.forward(batch, cache, device_logits=True)
            ids.append(
                int(sampler.sample(step, [greedy], [None], [prompt], [ids[len(prompt) :]]).token_ids[0])
            )
        else:
            if not logits:
                batch.logits_indices = np.arange(batch.num_tokens, dtype=np.int32)  # every prompt row
            logits.append(model.forward(batch, cache))
            ids.append(int(logits[-1][-1].argmax()))
        chunk = ScheduledChunk(ids[-1:], len(ids) - 1, table, True)
    return ids[len(prompt) :], np.concatenate(logits) if logits else None


def check_models(report) -> None:
    """Greedy tokens of whole models, eager, on the GPU against the CPU backend: the bundled stories260K and
    a random model with a 92,544-token vocabulary, in float32 (tokens identical) and bfloat16 (logits close;
    the device's greedy sampler agrees with a host argmax of the same logits)."""
    new_tokens = 8 if report.quick else 24
    prompt = np.random.default_rng(1).integers(3, 500, 100).tolist()
    for label, path, tokens in [
        ("stories260K", default_model_dir(), PROMPT),
        (f"random vocab {LARGE_VOCAB}", large_vocab_model(report.scratch), prompt),
    ]:
        report.check(f"model {label}", check_model, report, label, path, tokens, new_tokens)


def check_model(report, label: str, path: Path, prompt: list[int], new_tokens: int) -> None:
    ref_ids, ref_logits = generate(build_model(path, CpuOps()), prompt, new_tokens)
    model = build_model(path, make_ops("float32"))
    ids, logits = generate(model, prompt, new_tokens)
    error = float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max())
    report.row(
        f"model {label} fp32",
        "ok" if ids == ref_ids else "MISMATCH",
        f"{new_tokens} greedy tokens {'identical' if ids == ref_ids else 'differ'}; logits rel err "
        f"{error:.1e}",
    )
    on_device, _ = generate(model, prompt, new_tokens, on_device=True)
    report.row(
        f"model {label} fp32 GpuSampler",
        "ok" if on_device == ref_ids else "MISMATCH",
        "greedy tokens sampled on the device " + ("identical" if on_device == ref_ids else "differ"),
    )
    bf16 = build_model(path, make_ops("bfloat16"))
    host_ids, bf16_logits = generate(bf16, prompt, 8)
    first = ref_logits[: len(prompt)]
    error = float(np.abs(bf16_logits[: len(prompt)] - first).max() / np.abs(first).max())
    report.row(
        f"model {label} bf16", "ok" if error <= 0.06 else "MISMATCH", f"prefill logits rel err {error:.3f}"
    )
    device_ids, _ = generate(bf16, prompt, 8, on_device=True)
    report.row(
        f"model {label} bf16 GpuSampler",
        "ok" if host_ids == device_ids else "MISMATCH",
        "device greedy == host argmax" if host_ids == device_ids else f"{device_ids} vs {host_ids}",
    )


# ---- CUDA graphs and overlap against eager --------------------------------------------------------------


def check_linear_capture(report) -> None:
    """One linear (cuBLAS) captured with ops.launcher.capture: a replay equals eager, also after the input
    changed in place (the graph reads its buffers, not a copy). CuPy's own cuBLAS wrapper refuses capture."""
    rng = np.random.default_rng(4)
    for dtype in ("float32", "float16", "bfloat16"):

        def capture_one():
            ops = make_ops(dtype)
            x, w, b = (ops.weight(random_host(rng, s, dtype)) for s in [(8, 512), (384, 512), (384,)])
            eager = np.array(
                ops.to_numpy(ops.linear(x, w, b))
            )  # copies: the emulator's arrays are host memory
            graph, out = ops.launcher.capture(lambda: ops.linear(x, w, b))
            graph.launch()
            first = np.array(ops.to_numpy(out))
            x[...] = ops.weight(random_host(rng, (8, 512), dtype))
            graph.launch()
            again, want = np.array(ops.to_numpy(out)), ops.to_numpy(ops.linear(x, w, b))
            errors = [float(np.abs(a - e).max()) for a, e in [(first, eager), (again, want)]]
            ok = max(errors) <= TOLERANCE[dtype] * max(1.0, float(np.abs(want).max()))
            report.row(
                f"graph linear {dtype}",
                "ok" if ok else "MISMATCH",
                f"replay vs eager max diff {errors[0]:.1e}, after a new input {errors[1]:.1e}",
            )

        report.check(f"graph linear {dtype}", capture_one)


class CaptureLog(logging.Handler):
    """Counts the launcher's graph captures (and keeps the first one's failure) and the engine's warnings,
    so that an engine that fell back to eager does not pass as graphs == eager."""

    def __init__(self, launcher_class):
        super().__init__(logging.WARNING)
        self.captures, self.failure, self.warnings = 0, None, []
        original = launcher_class.capture

        def capture(launcher, fn):
            try:
                result = original(launcher, fn)
            except Exception as exc:
                self.failure = self.failure or exc
                raise
            self.captures += 1
            return result

        launcher_class.capture = capture
        logging.getLogger("minisarathi").addHandler(self)

    def emit(self, record) -> None:
        self.warnings.append(record.getMessage()[:200])


REQUESTS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=24, logprobs=2),
    SamplingParams(temperature=1.0, seed=5, max_tokens=24, stop_token_ids=list(range(300, 360))),
]


def engine_run(path: Path, **options):
    """(tokens, finish reason and logprob ids of 8 requests decoding together, decode steps' records)."""
    from minisarathi.engine.engine import LLMEngine

    engine = LLMEngine(path, device=DEVICE, num_kv_blocks=256, max_num_seqs=8, **options)
    for i in range(8):
        engine.add_request(str(i), [1, 403 + i, 407, 261, 378], REQUESTS[i % 3])
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    results = {
        rid: (c.token_ids, c.finish_reason, [sorted(lp) for lp in c.logprobs or []])
        for rid, c in finals.items()
    }
    return results, [r for r in engine.step_records if r.num_prefill_tokens == 0]


def differences(a: dict, b: dict) -> str:
    bad = [rid for rid in a if a[rid] != b[rid]]
    if not bad:
        return "same tokens, logprob ids, finish reasons"
    first = min(
        next((i for i, (x, y) in enumerate(zip(a[r][0], b[r][0])) if x != y), len(a[r][0])) for r in bad
    )
    return f"requests {', '.join(bad)} differ, the first at token {first}"


def check_graphs(report) -> None:
    """Decode steps replayed as CUDA graphs against every step eager (the engine, overlap off): the bundled
    model and the large-vocabulary one in float32, where tokens must be identical, and the latter in bfloat16,
    where they may differ without failing (padding rows change the matmuls' shapes, so cuBLAS may round
    differently and flip one of a random model's many near ties; a stale graph input would differ from the
    first replay)."""
    log = CaptureLog(type(make_ops("float32").launcher))
    large = large_vocab_model(report.scratch)
    cases = [
        ("stories260K fp32", default_model_dir(), "float32"),
        (f"vocab {LARGE_VOCAB} fp32", large, "float32"),
        (f"vocab {LARGE_VOCAB} bf16", large, "bfloat16"),
    ]
    # The emulator runs each co-resident CTA of a split sampler row as 1024 fibers: 8 rows of 92,544 tokens
    # pass Linux's default vm.max_map_count, so a dry run compares the bundled model only.
    for label, path, dtype in (
        cases[:1] if DEVICE == "cuda-emulated" else cases[:2] if report.quick else cases
    ):

        def compare_runs():
            log.failure = None
            eager, _ = engine_run(path, dtype=dtype, cuda_graphs=False, overlap=False)
            before = log.captures
            graphs, _ = engine_run(path, dtype=dtype, cuda_graphs=True, overlap=False)
            captured = log.captures - before
            if log.failure is not None:
                report.error(log.failure, f"graph capture ({label})")
            elif not captured:
                report.row(
                    f"graph capture ({label})",
                    "ERROR",
                    "no graph was captured: the engine ran eagerly "
                    f"({'; '.join(log.warnings[-2:]) or 'no warning logged'})",
                )
            report.row(
                f"engine graphs == eager {label}",
                "ok" if graphs == eager else "MISMATCH" if dtype == "float32" else "differs",
                f"{differences(graphs, eager)}; {captured} graphs captured",
            )

        report.check(f"engine graphs {label}", compare_runs)


def check_overlap(report) -> None:
    """The engine with overlap (the next step issued before the sampled ids reach the host) against without,
    CUDA graphs off, then the defaults (graphs and overlap on) against every step eager: tokens, logprob ids
    and finish reasons of 8 requests (greedy, seeded, stopped by a token while the next step was in
    flight)."""
    path = default_model_dir()
    runs = {}
    for name, options in {
        "eager": dict(overlap=False, cuda_graphs=False),
        "overlap": dict(overlap=True, cuda_graphs=False),
        "defaults": dict(overlap=True, cuda_graphs=True),
    }.items():
        runs[name] = report.check(f"engine {name}", lambda o=options: engine_run(path, **o))
    if None in runs.values():
        return
    (eager, _), (overlap, steps), (defaults, default_steps) = runs["eager"], runs["overlap"], runs["defaults"]
    report.row(
        "engine overlap == no overlap", "ok" if overlap == eager else "MISMATCH", differences(overlap, eager)
    )
    report.row(
        "engine defaults == eager",
        "ok" if defaults == eager else "MISMATCH",
        "graphs + overlap: " + differences(defaults, eager),
    )
    for name, records in [("eager", runs["eager"][1]), ("overlap", steps), ("defaults", default_steps)]:
        host, wait, step = (
            1e3 * float(np.mean([getattr(r, f) for r in records]))
            for f in ("host_time", "ids_wait_time", "step_time")
        )
        report.row(
            f"  host / ids wait per decode step, {name}",
            f"{host:.2f} ms",
            f"+ {wait:.2f} ms waiting for ids = {step:.2f} ms (stories260K, 8 requests)",
        )


# ---- speed ----------------------------------------------------------------------------------------------


def measure_ceilings(report) -> None:
    import cupy

    a = cupy.empty(1 << 30, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    copy = 2 * a.nbytes / timed(lambda: cupy.copyto(b, a))  # read + write
    ops, n = make_ops("bfloat16"), 8192
    x, w = random_device(ops, (n, n)), random_device(ops, (n, n))
    matmul = 2 * n**3 / timed(lambda: ops.linear(x, w), repeat=10)
    report.data = {"copy_bytes_per_s": copy, "bf16_flop_per_s": matmul}
    report.row("ceiling device copy", f"{copy / 1e9:.0f} GB/s", "1 GiB cupy.copyto, read+write")
    report.row("ceiling bf16 matmul", f"{matmul / 1e12:.0f} TFLOP/s", "8192^3 through ops.linear (cuBLAS)")


def bandwidth_row(
    report,
    name: str,
    seconds: float,
    nbytes: float,
    target: float | None = None,
    verdict: str | None = None,
    note: str = "",
) -> None:
    """A row of seconds and GB/s, as a share of the measured copy ceiling and of the target share if any."""
    copy = report.earlier("ceilings").get("copy_bytes_per_s")
    rate = nbytes / seconds
    share = f"{100 * rate / copy:.0f}% of copy" if copy else "no ceiling"
    met = (
        ""
        if target is None or not copy
        else " (target met)"
        if rate >= target * copy
        else f" (target {target:.0%})"
    )
    report.row(
        f"speed {name}", verdict or f"{seconds * 1e6:.0f} us", f"{rate / 1e9:.0f} GB/s, {share}{met}{note}"
    )


def time_kernels(report) -> None:
    """The element-wise kernels at Llama-3-8B's shapes (bf16), then the samplers at 64 x 128k."""
    ops = make_ops("bfloat16")
    H, Hq, Hk, D, I = 4096, 32, 8, 128, 14336
    table = random_device(ops, (128256, H))
    cos_sin = ops.constant(
        rope_cos_sin_table((1.0 / 500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32), 8192)
    )
    for T in (1, 512):
        x, r, w = random_device(ops, (T, H)), random_device(ops, (T, H)), random_device(ops, (H,))
        bandwidth_row(report, f"rms_norm T={T}", timed(lambda: ops.rms_norm(x, w, 1e-5)), 2 * x.nbytes)
        bandwidth_row(
            report, f"add_rms_norm T={T}", timed(lambda: ops.add_rms_norm(x, r, w, 1e-5)), 4 * x.nbytes
        )
        g = random_device(ops, (T, 2 * I))
        bandwidth_row(report, f"silu_and_mul T={T}", timed(lambda: ops.silu_and_mul(g)), 1.5 * g.nbytes)
        qkv = random_device(ops, (T, (Hq + 2 * Hk) * D))
        q, k, v = (
            qkv[:, : Hq * D].reshape(T, Hq, D),
            qkv[:, Hq * D : (Hq + Hk) * D].reshape(T, Hk, D),
            qkv[:, (Hq + Hk) * D :].reshape(T, Hk, D),
        )
        k_cache, v_cache = (
            random_device(ops, (T // 16 + 1, Hk, 16, D)),
            random_device(ops, (T // 16 + 1, Hk, 16, D)),
        )
        positions = slots = np.arange(T, dtype=np.int32)
        bandwidth_row(
            report,
            f"rope_store_kv T={T}",
            timed(lambda: ops.rope_store_kv(q, k, v, k_cache, v_cache, positions, slots, cos_sin)),
            2 * qkv.nbytes,
        )  # read Q, K, V; write Q, K, V
        bandwidth_row(
            report, f"embedding T={T}", timed(lambda: ops.embedding(table, positions)), 2 * T * H * 2
        )

    f32 = make_ops("float32")
    N, V = 64, 128256
    logits = f32.launcher.to_device((np.random.default_rng(3).standard_normal((N, V)) * 2).astype(np.float32))
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, logprobs=2)] * N
    sampler = f32.new_sampler(V)
    seconds = timed(lambda: sampler.sample(logits, params, [None] * N, [[1, 2, 3]] * N, [[4]] * N), repeat=5)
    report.row(
        f"speed GpuSampler {N}x{V}", f"{seconds * 1e6:.0f} us", "penalty, top-k/top-p, logprobs; ids to host"
    )
    columns = (np.ones(N), np.full(N, 50), np.full(N, 0.9), np.zeros(N), np.full(N, 0.5))
    device_s = timed(lambda: f32.sample(logits, *columns))
    report.row(
        f"speed ops.sample top-k 50 top-p 0.9 {N}x{V}",
        f"{device_s * 1e6:.0f} us",
        "on the device: parameter upload, sample_kernel and its workspace memset; target <= 100 us",
    )
    op_s = timed(lambda: f32.launcher.to_host(f32.sample(logits, *columns)))
    report.row(
        f"speed ops.sample + ids to host {N}x{V}", f"{op_s * 1e6:.0f} us", "the whole op, as the engine waits"
    )


# Llama-3-8B-shaped attention (32 query / 8 KV heads, head_dim 128, bf16, blocks of 16) through
# ops.paged_attention, so it measures whichever kernels the backend chooses: label, (history, new tokens) per
# sequence, target (FLOP/s for prefill, a fraction of the copy ceiling for decode), in --quick
ATTENTION_CASES = [
    ("prefill 2048 @0", [(0, 2048)], 350e12, False),
    ("prefill 2048 @8k", [(8192, 2048)], 350e12, True),
    ("prefill 2048 @30k", [(30720, 2048)], 350e12, False),
    ("decode 64x4k", [(4095, 1)] * 64, 0.80, True),
    ("decode 1x512", [(511, 1)], None, False),
    ("decode 1x32k", [(32767, 1)], 0.60, True),
    # A graph bucket's plan (planned for 128k-key rows, each row's keys cut on the device): near the eager
    # rows.
    ("decode bucket 64x4k @128k", [(4095, 1)] * 64, 0.70, True),
    ("decode bucket 1x4k @128k", [(4095, 1)], None, False),
]
BUCKET_CAPACITY = 131072  # the "@128k" cases' plan_context_len


def time_attention(report) -> None:
    ops = make_ops("bfloat16")
    for label, runs, target, quick in ATTENTION_CASES:
        if quick or not report.quick:
            report.check(f"attention {label}", time_attention_case, report, ops, label, runs, target)


def time_attention_case(report, ops, label: str, runs: list[tuple[int, int]], target) -> None:
    Hq, Hk, D, bs = 32, 8, 128, 16
    blocks = [-(-(history + n) // bs) for history, n in runs]
    chunks, first = [], 0
    for (history, n), count in zip(runs, blocks):
        chunks.append(ScheduledChunk([1] * n, history, list(range(first, first + count)), True))
        first += count
    batch = build_batch(chunks, bs)
    if "bucket" in label:  # as decode_graphs.pad_to_bucket makes it: tables as wide as the capacity
        tables = np.zeros((batch.num_seqs, BUCKET_CAPACITY // bs), np.int32)  # int32[S, 8192]
        tables[:, : batch.block_tables.shape[1]] = batch.block_tables
        batch.block_tables, batch.plan_context_len = tables, BUCKET_CAPACITY
    k_cache, v_cache = random_device(ops, (first, Hk, bs, D)), random_device(ops, (first, Hk, bs, D))
    q = random_device(ops, (batch.num_tokens, Hq, D))
    scale = D**-0.5
    out = ops.paged_attention(q, k_cache, v_cache, batch, scale)
    seconds = timed(lambda: ops.paged_attention(q, k_cache, v_cache, batch, scale), repeat=10)
    # Error against NumPy on a sample, so the CPU reference stays seconds: a chunk's last 32 query rows (over
    # its whole history), or a decode batch's first two sequences.
    history, n = runs[0]
    if n > 1:
        m = min(32, n)
        sample, rows, used = (
            build_batch([ScheduledChunk([1] * m, history + n - m, chunks[0].block_table, True)], bs),
            slice(n - m, n),
            blocks[0],
        )
    else:
        sample, rows, used = build_batch(chunks[:2], bs), slice(0, min(2, len(runs))), sum(blocks[:2])
    want = CpuOps().paged_attention(
        ops.to_numpy(q[rows]), ops.to_numpy(k_cache[:used]), ops.to_numpy(v_cache[:used]), sample, scale
    )
    error = float(np.abs(ops.to_numpy(out[rows]) - want).max() / max(1.0, np.abs(want).max()))
    verdict = None if error <= TOLERANCE["bfloat16"] else "MISMATCH"
    if n > 1:
        flops = 4 * D * Hq * sum(n * h + n * (n + 1) // 2 for h, n in runs)
        matmul = report.earlier("ceilings").get("bf16_flop_per_s")
        share = f", {100 * flops / seconds / matmul:.0f}% of bf16 matmul" if matmul else ""
        met = " (target met)" if flops / seconds >= target else f" (target {target / 1e12:.0f})"
        report.row(
            f"attention {label}",
            verdict or f"{seconds * 1e6:.0f} us",
            f"{flops / seconds / 1e12:.1f} TFLOP/s{share}{met}; err {error:.1e}",
        )
    else:
        bandwidth_row(
            report,
            f"attention {label}",
            seconds,
            2 * sum(h + 1 for h, _ in runs) * Hk * D * 2,
            target,
            verdict,
            f"; err {error:.1e}",
        )


LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


class WeightShape:
    """Stands in for a checkpoint tensor: random_8b_model's ops.weight reads only the shape."""

    def __init__(self, *shape: int):
        self.shape = shape


def random_8b_model():
    """(LlamaModel, ops): Llama-3-8B's shapes in bf16 with random weights made on the GPU (about 16 GB)."""
    from minisarathi.config import ModelConfig
    from minisarathi.model.llama import LlamaModel

    config = ModelConfig.from_dict(LLAMA3_8B)
    ops = make_ops("bfloat16")
    ops.weight = lambda w: random_device(ops, w.shape, w.shape[-1] ** -0.5 if len(w.shape) == 2 else 1.0)
    H, I, V, D = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    Hq, Hk = config.num_attention_heads, config.num_key_value_heads
    weights = {"embed_tokens": WeightShape(V, H), "norm": WeightShape(H), "lm_head": WeightShape(V, H)}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        weights |= {
            p + "input_layernorm": WeightShape(H),
            p + "qkv_proj": WeightShape((Hq + 2 * Hk) * D, H),
            p + "o_proj": WeightShape(H, Hq * D),
            p + "post_attention_layernorm": WeightShape(H),
            p + "gate_up_proj": WeightShape(2 * I, H),
            p + "down_proj": WeightShape(H, I),
        }
    return LlamaModel(config, weights, ops), ops


def host_and_device_seconds(fn, repeat: int = 20) -> tuple[float, float]:
    """Medians of (host seconds to issue fn(), device seconds between events around it). When the host is the
    slower one, the device waits for it and the event time is about the host time."""
    import cupy

    fn()
    cupy.cuda.get_current_stream().synchronize()
    host_s, device_s = [], []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        begin = time.perf_counter()
        fn()
        host_s.append(time.perf_counter() - begin)
        end.record()
        end.synchronize()
        device_s.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(host_s)), float(np.median(device_s))


def time_model_8b(report) -> None:
    """A Llama-3-8B-shaped model: a 2048-token prefill chunk, then decode steps at batch 1 and 64, eager and
    replayed as CUDA graphs (the engine's decode buckets), host issue time against device time."""
    import cupy

    model, ops = random_8b_model()
    c = model.config
    L, H, V, D = c.num_hidden_layers, c.hidden_size, c.vocab_size, c.head_dim
    Hq, Hk, bs = c.num_attention_heads, c.num_key_value_heads, 16
    decodes = {1: 512, 64: 1024}  # batch -> context
    prefill_blocks = 2048 // bs
    cache = model.new_kv_cache(prefill_blocks + sum(S * ctx // bs for S, ctx in decodes.items()), bs)
    for k_cache, v_cache in cache:  # never time attention over zeros
        k_cache[...] = random_device(ops, k_cache.shape)
        v_cache[...] = random_device(ops, v_cache.shape)
    weight_bytes = (
        sum(
            getattr(layer, f).nbytes
            for layer in model.layers
            for f in layer.__dataclass_fields__
            if getattr(layer, f) is not None
        )
        + model.lm_head.nbytes
        + model.norm.nbytes
    )
    matmul_params = (Hq + 2 * Hk) * D * H + H * Hq * D + 3 * H * c.intermediate_size

    prefill = build_batch([ScheduledChunk([7] * 2048, 0, list(range(prefill_blocks)), True)], bs)
    seconds = timed(lambda: model.forward(prefill, cache, device_logits=True), repeat=5)
    flops = L * (2 * 2048 * matmul_params + 4 * D * Hq * 2048 * 2049 // 2) + 2 * H * V
    matmul = report.earlier("ceilings").get("bf16_flop_per_s")
    report.row(
        "model-8b prefill chunk 2048",
        f"{seconds * 1e3:.1f} ms",
        f"{flops / seconds / 1e12:.0f} TFLOP/s"
        + (f", {100 * flops / seconds / matmul:.0f}% of bf16 matmul" if matmul else ""),
    )

    first, batches = prefill_blocks, {}
    for S, ctx in decodes.items():
        chunks = [
            ScheduledChunk(
                [5], ctx - 1, list(range(first + s * ctx // bs, first + (s + 1) * ctx // bs)), True
            )
            for s in range(S)
        ]
        first += S * ctx // bs
        batch = batches[S] = build_batch(chunks, bs)
        host_s, device_s = host_and_device_seconds(lambda: model.forward(batch, cache, device_logits=True))
        bandwidth_row(
            report,
            f"model-8b decode bs={S} @{ctx}",
            device_s,
            weight_bytes + 2 * S * ctx * L * Hk * D * 2,
            target=0.85 if S == 1 else 0.75,
        )
        report.row(
            f"  host / GPU per step bs={S} eager",
            f"{host_s * 1e3:.2f} ms",
            f"GPU (events) {device_s * 1e3:.2f} ms",
        )
        q, (k_cache, v_cache) = random_device(ops, (S, Hq, D)), cache[0]
        attention = timed(lambda: ops.paged_attention(q, k_cache, v_cache, batch, D**-0.5))
        report.row(
            f"  attention share bs={S}",
            f"{100 * L * attention / device_s:.0f}%",
            f"{L} x {attention * 1e6:.0f} us of {device_s * 1e3:.2f} ms",
        )

    def graph_steps():
        # As the engine runs decode steps with CUDA graphs on: every bucket captured at start-up, each step
        # padded to its bucket, attention planned for the model's whole context, one upload and one replay.
        begin = time.perf_counter()
        buckets = model.use_decode_buckets(
            max_num_seqs=64, max_model_len=c.max_position_embeddings, block_size=bs, kv_cache=cache
        )
        cupy.cuda.get_current_stream().synchronize()
        report.row("model-8b graphs captured", f"{time.perf_counter() - begin:.1f} s", f"buckets {buckets}")
        for S, batch in batches.items():
            host_s, device_s = host_and_device_seconds(
                lambda: model.forward(batch, cache, device_logits=True)
            )
            report.row(
                f"  host / GPU per step bs={S} graph",
                f"{host_s * 1e3:.3f} ms",
                f"GPU (replay) {device_s * 1e3:.2f} ms",
            )

    report.check("model-8b graphs", graph_steps)


# ---- compute-sanitizer and NCCL ---------------------------------------------------------------------------


def run_sanitizer(report) -> None:
    """memcheck and racecheck over small_forward(). Some GPU runtimes refuse the sanitizer ("Device not
    supported"): that, a missing tool or a time-out is an n/a row."""
    exe = shutil.which("compute-sanitizer") or next(
        (str(p) for p in (Path("/usr/local/cuda/bin/compute-sanitizer"),) if p.exists()), None
    )
    if exe is None:
        report.row("compute-sanitizer", "n/a", "not installed")
        return
    for tool in ("memcheck", "racecheck"):
        try:
            result = subprocess.run(
                [exe, "--tool", tool, "--error-exitcode", "3", sys.executable, __file__, "--small-forward"],
                capture_output=True,
                text=True,
                timeout=13,
                cwd=REPO,
            )
        except subprocess.TimeoutExpired:
            report.row(f"compute-sanitizer {tool}", "n/a", "time-boxed at 13 s")
            continue
        text = result.stdout + result.stderr
        print(f"[compute-sanitizer {tool}, exit {result.returncode}]\n{text[-3000:]}", flush=True)
        refusal = next((line for line in text.splitlines() if "not supported" in line.lower()), None)
        if refusal:
            report.row("compute-sanitizer", "n/a", f"refused: {refusal.strip()[:80]}")
            return
        summary = next(
            (line.strip() for line in text.splitlines() if "SUMMARY" in line), f"exit {result.returncode}"
        )
        report.row(
            f"compute-sanitizer {tool}", {0: "ok", 3: "ERROR"}.get(result.returncode, "n/a"), summary[:90]
        )


def small_forward() -> None:
    """The bundled model in float32: a prompt, three tokens sampled on the device and a top-k/top-p draw, so
    that every kernel launches at least once."""
    model = build_model(default_model_dir(), make_ops("float32"))
    ids, _ = generate(model, PROMPT, 3, on_device=True)
    ops = model.ops
    logits = ops.launcher.to_device(np.random.default_rng(0).standard_normal((4, 1000)).astype(np.float32))
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01)] * 4
    drawn = ops.new_sampler(1000).sample(logits, params, [None] * 4, [[1]] * 4, [[]] * 4).token_ids
    print("small forward:", ids, drawn.tolist(), flush=True)


def check_nccl(report) -> None:
    """The bundled model split over two GPUs (a rank process per GPU, all-reduces through NCCL) against the
    same model on one: greedy tokens identical, logits within float32 tolerance. With one GPU it says so."""
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if count < 2:
        report.row("nccl TP=2", "skipped: one GPU", f"{count} GPU visible; TP over NCCL needs two")
        return
    from cupy.cuda import nccl

    from minisarathi.parallel.group import TensorParallelModel, find_mpiexec

    if not nccl.available:
        report.row(
            "nccl TP=2", "MISSING", "NCCL is not loadable by CuPy: pip install 'nvidia-nccl-cu13' (or -cu12)"
        )
        return
    try:
        find_mpiexec()
    except ValueError as exc:
        report.row("nccl TP=2", "MISSING", str(exc))
        return
    path = default_model_dir()
    want_ids, want_logits = generate(build_model(path, make_ops("float32")), PROMPT, 24)
    two = TensorParallelModel(path, "cuda", "float32", 2, rank_timeout_s=15)
    try:
        ids, logits = generate(two, PROMPT, 24)
    finally:
        two.close()
    error = float(np.abs(logits - want_logits).max() / np.abs(want_logits).max())
    ok = ids == want_ids and error <= TOLERANCE["float32"]
    report.row(
        "nccl TP=2 vs TP=1 stories260K fp32",
        "ok" if ok else "MISMATCH",
        f"greedy tokens {'identical' if ids == want_ids else 'differ'}, logits rel err {error:.1e}",
    )


# ---- the sections, in the order they run
# -------------------------------------------------------------------- Limits (s) of a full run and of --quick
# (None: not in --quick) add up to under BUDGET_S, so every section gets its turn whatever hangs. Correctness
# runs with CUDA_LAUNCH_BLOCKING=1: a kernel's error is raised by its own launch, so the first failing call
# names it. Not the others: blocking launches do not mix with stream capture, and would serialize the overlap
# and the speed they measure.
BLOCKING = {"CUDA_LAUNCH_BLOCKING": "1"}
SECTIONS = [
    Section("env", check_environment, 30, 30, "correctness", CPU, required=True),
    Section("compile", compile_kernels, 65, 45, "correctness", CPU),
    Section("ops-float32", check_ops, 30, 20, "correctness", CPU, ("float32",), BLOCKING),
    Section("ops-bfloat16", check_ops, 30, 20, "correctness", CPU, ("bfloat16",), BLOCKING),
    Section("ops-float16", check_ops, 20, None, "correctness", CPU, ("float16",), BLOCKING),
    Section("sampling", check_sampling, 30, 20, "correctness", CPU, env=BLOCKING),
    Section("models", check_models, 40, 25, "correctness", CPU, env=BLOCKING),
    Section("graph-linear", check_linear_capture, 15, 10, "graphs", "cuda_graphs=False"),
    Section("graphs", check_graphs, 35, 20, "graphs", "cuda_graphs=False"),
    Section("overlap", check_overlap, 30, 20, "overlap", "overlap=False"),
    Section("ceilings", measure_ceilings, 15, 10, "speed"),
    Section("kernel-speed", time_kernels, 15, None, "speed"),
    Section("attention", time_attention, 35, 20, "speed"),
    Section("model-8b", time_model_8b, 45, 30, "speed"),
    Section("sanitizer", run_sanitizer, 30, None, "speed"),
    Section("nccl", check_nccl, 15, None, "speed"),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path("gpu_check_out"), help="summary.txt and summary.json"
    )
    parser.add_argument("--quick", action="store_true", help=f"the shorter run (under {BUDGET_S['quick']} s)")
    parser.add_argument(
        "--section",
        action="append",
        choices=[s.name for s in SECTIONS],
        help="run only these sections (repeatable), each still in its own process",
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cuda-emulated"],
        default="cuda",
        help="cuda-emulated: a dry run of the correctness and graph sections on the CPU emulator",
    )
    parser.add_argument("--list", action="store_true", help="print the sections and their limits")
    parser.add_argument(
        "--small-forward", action="store_true", help=argparse.SUPPRESS
    )  # what the sanitizer runs
    args = parser.parse_args()
    if args.small_forward:
        small_forward()
        return
    mode = "quick" if args.quick else "full"
    sections = [
        s
        for s in SECTIONS
        if (args.quick and s.quick_s is not None or not args.quick)
        and (not args.section or s.name in args.section or s.required)
        and (args.device == "cuda" or s.stage != "speed")
    ]
    if args.list:
        for s in sections:
            print(f"{s.name:14s} {s.stage:12s} limit {s.limit_s:3.0f} s, --quick {s.quick_s or '-'}")
        return
    os.environ["GPU_CHECK_DEVICE"] = args.device  # the sections' processes read it
    slower = 1 if args.device == "cuda" else 20  # the emulator runs kernels on the CPU
    sections = [
        dataclasses.replace(s, limit_s=s.limit_s * slower, quick_s=s.quick_s and s.quick_s * slower)
        for s in sections
    ]
    results = run_sections(
        sections,
        args.out.resolve(),
        BUDGET_S[mode] * slower,
        args.quick,
        f"gpu_check {mode} on {args.device}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    )
    sys.exit(exit_code(results))


if __name__ == "__main__":
    main()
