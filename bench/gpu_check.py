"""The CUDA backend on a real GPU: correctness against NumPy, then speed against measured ceilings.

    python3 bench/gpu_check.py --out DIR                  # every section (what bench/gpu_check.sh runs; GPU + CuPy)
    python3 bench/gpu_check.py --out DIR --section NAME   # one section: kernels, sampling, models, ceilings, ...
    python3 bench/gpu_check.py --ptxas-report             # registers / shared memory / spills per kernel (nvcc, no GPU)

Each section runs in its own process under a time limit, so an exception, a hang, or a CUDA error that
poisons the context (an illegal address is sticky) costs that section only. The section limits add up to
less than TOTAL_BUDGET_S, so every section gets its turn. DIR receives three files (the GPU machine returns
at most 8): summary.txt and results.json, rewritten after every section (a kill still leaves them), and
details.txt, appended to; per-section rows and the measured ceilings live in a scratch folder (--work).
Without CuPy or a GPU the summary says what is missing and what to install, and the exit code is 2.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minisarathi.backends import cuda_ops  # noqa: E402
from minisarathi.backends.numpy_ops import NumpyOps
from minisarathi.config import rope_cos_sin_table  # noqa: E402
from minisarathi.dtypes import bf16_to_float32, float32_to_bf16  # noqa: E402
from minisarathi.testing import ScheduledChunk, build_batch  # noqa: E402
from minisarathi.paths import cuda_dir, default_model_dir  # noqa: E402
from minisarathi.sampler import Sampler, make_generator  # noqa: E402
from minisarathi.sampling_params import SamplingParams  # noqa: E402

TOTAL_BUDGET_S = 392     # all sections; gpu_check.sh kills the run at 395 s: with start-up, under 7 minutes
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 3e-2}
FAILURES = ("ERROR", "MISMATCH", "FAILED", "SKIPPED", "MISSING")
INSTALL_HINT = ("pip install cupy-cuda13x 'cuda-toolkit[nvrtc,cudart,cublas]==13.0.*' (CUDA 13 driver) or "
                "cupy-cuda12x nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cublas-cu12 (CUDA 12)")
ROWS: list[tuple[str, str, str]] = []   # (check, result, detail) of this process's section
DETAILS: list[str] = []


def log(line: str) -> None:
    print(line, flush=True)
    DETAILS.append(line)


def guarded(name: str, fn, *args) -> None:
    """Runs one check; an exception becomes an ERROR row and the section goes on with the next check."""
    try:
        fn(*args)
    except Exception as exc:
        ROWS.append((name, "ERROR", f"{type(exc).__name__}: {exc}".splitlines()[0][:90]))
        log(f"[{name}] failed:\n{traceback.format_exc()}")


# ---- helpers -------------------------------------------------------------------------------------------

def host(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to dtype, as float32 (what the GPU sees)."""
    if dtype == "bfloat16":
        return bf16_to_float32(float32_to_bf16(x))
    return x.astype(dtype).astype(np.float32)


def compare(name: str, ops, got, want: np.ndarray, dtype: str) -> None:
    got = ops.to_numpy(got)
    scale = max(1.0, float(np.abs(want).max()))
    error = float(np.abs(got - want).max()) / scale
    ok = error <= TOLERANCE[dtype]
    ROWS.append((f"kernel {name} {dtype}", "ok" if ok else "MISMATCH", f"max error {error:.2e} of scale"))
    log(f"  {name:28s} {dtype:9s} error {error:.2e} {'ok' if ok else 'MISMATCH'}")


def timed(fn, repeat: int = 20) -> float:
    """Median seconds of fn() on the GPU, between CUDA events on the current stream, after a warm-up
    (which also compiles the kernels)."""
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
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)   # milliseconds -> seconds
    return float(np.median(times))


def random_device(ops, shape, scale=1.0):
    """Random activations/weights made on the GPU in the activation dtype (fast even for an 8B shape)."""
    import cupy
    x = cupy.random.standard_normal(shape, dtype=cupy.float32)
    x *= np.float32(scale)
    return cuda_ops.convert(x, "float32", ops.dtype)


# ---- (a) kernels against NumPy -------------------------------------------------------------------------

def check_kernels(work: Path) -> None:
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    log(f"device: {name.decode() if isinstance(name, bytes) else name}, CuPy {cupy.__version__}")
    for dtype in ("float32", "float16", "bfloat16"):
        guarded(f"kernels {dtype}", check_kernels_in, dtype)


def check_kernels_in(dtype: str) -> None:
    rng = np.random.default_rng(0)
    ops = cuda_ops.gpu(dtype)
    x32, w32, r32 = (host(rng.standard_normal(s).astype(np.float32), dtype) for s in [(9, 1000), (1000,), (9, 1000)])
    x, w, r = ops.weight(x32), ops.weight(w32), ops.weight(r32)
    compare("rms_norm", ops, ops.rms_norm(x, w, 1e-5), NumpyOps().rms_norm(x32, w32, 1e-5), dtype)
    out, _ = ops.add_rms_norm(x, r, w, 1e-5)
    compare("add_rms_norm", ops, out, NumpyOps().add_rms_norm(x32, r32.copy(), w32, 1e-5)[0], dtype)
    compare("silu_and_mul", ops, ops.silu_and_mul(x), NumpyOps().silu_and_mul(x32), dtype)
    ids = np.array([0, 5, 999, 5], dtype=np.int32)
    table32 = host(rng.standard_normal((1000, 64)).astype(np.float32), dtype)
    compare("embedding", ops, ops.embedding(ops.weight(table32), ids), table32[ids], dtype)
    wl32 = host(rng.standard_normal((300, 1000)).astype(np.float32) * 0.05, dtype)
    b32 = host(rng.standard_normal(300).astype(np.float32), dtype)
    compare("linear+bias", ops, ops.linear(x, ops.weight(wl32), ops.weight(b32)), x32 @ wl32.T + b32, dtype)

    T, Hq, Hk, D, bs = 7, 32, 8, 128, 16
    qkv32 = host(rng.standard_normal((T, (Hq + 2 * Hk) * D)).astype(np.float32), dtype)
    positions = np.array([0, 1, 2, 3, 100, 5000, 130000], dtype=np.int32)
    slots = np.array([5, 17, -1, 40, 3, 63, 22], dtype=np.int32)
    cos_sin = rope_cos_sin_table((1.0 / 500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32), 130001)
    split = lambda a: (a[:, :Hq * D].reshape(T, Hq, D), a[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D),   # noqa: E731
                       a[:, (Hq + Hk) * D:].reshape(T, Hk, D))
    qkv, k_cache, v_cache = ops.weight(qkv32), ops.zeros((4, Hk, bs, D)), ops.zeros((4, Hk, bs, D))
    ops.rope_store_kv(*split(qkv), k_cache, v_cache, positions, slots, ops.constant(cos_sin))
    ref, k_ref, v_ref = qkv32.copy(), np.zeros((4, Hk, bs, D), np.float32), np.zeros((4, Hk, bs, D), np.float32)
    NumpyOps().rope_store_kv(*split(ref), k_ref, v_ref, positions, slots, cos_sin)
    # Rotated values are rounded to the dtype once more on the GPU: compare after rounding the reference too.
    compare("rope_store_kv q (strided)", ops, qkv[:, :Hq * D], host(ref[:, :Hq * D], dtype), dtype)
    compare("rope_store_kv k cache", ops, k_cache, host(k_ref, dtype), dtype)
    compare("rope_store_kv v cache", ops, v_cache, v_ref, dtype)

    for label, runs in [("attention mixed", [(0, 1), (0, 37), (15, 1), (16, 1), (40, 9), (3000, 1)]),
                        ("attention long decode", [(4095, 1)] * 8 + [(20000, 1)])]:
        bs = 16
        blocks = [-(-(s + n) // bs) for s, n in runs]
        pool = rng.permutation(sum(blocks))
        chunks, used = [], 0
        for (s, n), need in zip(runs, blocks):
            chunks.append(ScheduledChunk([1] * n, s, [int(b) for b in pool[used:used + need]], True))
            used += need
        batch = build_batch(chunks, bs)
        shape = (len(pool), Hk, bs, D)
        k32, v32 = (host(rng.standard_normal(shape).astype(np.float32), dtype) for _ in range(2))
        q32 = host(rng.standard_normal((batch.num_tokens, Hq, D)).astype(np.float32), dtype)
        got = ops.paged_attention(ops.weight(q32), ops.weight(k32), ops.weight(v32), batch, D ** -0.5)
        compare(label, ops, got, NumpyOps().paged_attention(q32, k32, v32, batch, D ** -0.5), dtype)


# ---- (a') sampling on the device against the NumPy Sampler -----------------------------------------------

def check_sampling(work: Path) -> None:
    from minisarathi.backends.gpu_sampling import GpuSampler
    ops = cuda_ops.gpu("float32")
    rng = np.random.default_rng(2)
    N, V = 64, 128256
    logits = (rng.standard_normal((N, V)) * 2).astype(np.float32)
    logits[1, [10, 70000]] = 50.0                               # a tie: the lowest id wins
    device_logits = ops.launcher.to_device(logits)
    ok = np.array_equal(ops.launcher.to_host(ops.greedy(device_logits)), logits.argmax(1))
    ROWS.append(("kernel greedy argmax", "ok" if ok else "MISMATCH", f"{N} x {V}, ties to the lowest id"))

    kinds = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_k=50), dict(temperature=1.0, top_p=0.9),
             dict(temperature=1.0, min_p=0.1), dict(temperature=0.8, top_k=40, top_p=0.8, min_p=0.02, seed=5),
             dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5, logprobs=5),
             dict(temperature=1.0, seed=9, logprobs=3, min_tokens=3, stop_token_ids=[7])]
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(N)]
    prompts = [rng.integers(0, V, 50).tolist() for _ in range(N)]
    outputs = [rng.integers(0, V, 2).tolist() for _ in range(N)]
    make = lambda: [None if p.seed is None else make_generator(p.seed) for p in params]   # noqa: E731
    want = Sampler(V, 0, (2,)).sample(logits, params, make(), prompts, outputs)
    sampler = GpuSampler(ops, V, 0, (2,))
    got = sampler.sample(device_logits, params, make(), prompts, outputs)
    greedy = np.array([p.temperature == 0 for p in params])
    same = got.token_ids == want.token_ids
    rows = [i for i, w in enumerate(want.logprobs) if w is not None]
    same_ids = all([t for t, _ in got.logprobs[i]] == [t for t, _ in want.logprobs[i]] for i in rows if same[i])
    error = max((abs(g[1] - w[1]) for i in rows if same[i] for g, w in zip(got.logprobs[i], want.logprobs[i])),
                default=0.0)
    # Sampled rows may rarely differ where float32 (GPU) and float64 (NumPy) CDFs straddle the uniform.
    ok = same[greedy].all() and same[~greedy].mean() >= 0.9 and same_ids and error <= 1e-4
    ROWS.append(("GpuSampler vs Sampler", "ok" if ok else "MISMATCH",
                 f"greedy {same[greedy].sum()}/{greedy.sum()}, sampled {same[~greedy].sum()}/{(~greedy).sum()} "
                 f"same ids; logprob err {error:.1e}"))
    unseeded = [SamplingParams(**{k: v for k, v in kinds[i % len(kinds)].items() if k != "seed"}) for i in range(N)]
    seconds = timed(lambda: sampler.sample(device_logits, unseeded, [None] * N, prompts, outputs), repeat=5)
    ROWS.append((f"speed GpuSampler {N}x{V}", f"{seconds * 1e6:.0f} us", "penalties, filters, logprobs; ids to host"))
    guarded("sampling top-k 50 top-p 0.9", time_top_k_top_p, ops, logits, device_logits)


class FixedDraw:
    """A request's generator that always draws u: the NumPy Sampler then uses the uniforms given to the kernel."""
    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


def time_top_k_top_p(ops, logits: np.ndarray, device_logits) -> None:
    """Issue 11's target shape: temperature 1, top-k 50 and top-p 0.9 over every row of 64 x 128k, rows split
    over several CTAs (gpu_sampling.sample_plan). Same ids as the NumPy Sampler given the same uniforms (a
    float64 CDF straddling a uniform may rarely differ), then the kernel alone (parameters already on the
    device) and the whole op (upload, launch, ids to the host)."""
    import cupy
    from minisarathi.backends.gpu_sampling import launch_sample, sample_parameters, sample_plan
    N, V = logits.shape
    u = np.random.default_rng(3).uniform(size=N)
    columns = (np.ones(N), np.full(N, 50), np.full(N, 0.9), np.zeros(N), u)
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * N
    want = Sampler(V).sample(logits, params, [FixedDraw(x) for x in u], [[1]] * N, [[]] * N).token_ids
    got = ops.launcher.to_host(ops.sample(device_logits, *columns))
    plan = sample_plan(N, V, ops.launcher.multiprocessors)
    same = int((got == want).sum())
    ROWS.append((f"sample top-k 50 top-p 0.9 {N}x{V}", "ok" if same >= N - 2 else "MISMATCH",
                 f"{same}/{N} same ids as Sampler; {plan.ctas_per_row} CTAs/row, {plan.groups} groups"))
    kernel, device_params = ops.launcher.kernel("sampling.cu", "sample_kernel"), ops.launcher.to_device(
        sample_parameters(*columns, V))
    ids = cupy.empty(N, dtype=np.int32)
    kernel_seconds = timed(lambda: launch_sample(kernel, ops.launcher, device_logits, device_params, plan, ids))
    op_seconds = timed(lambda: ops.launcher.to_host(ops.sample(device_logits, *columns)))
    ROWS.append((f"speed sample_kernel top-k 50 top-p 0.9 {N}x{V}", f"{kernel_seconds * 1e6:.0f} us",
                 "kernel + workspace memset; target <= 100 us"))
    ROWS.append((f"speed ops.sample top-k 50 top-p 0.9 {N}x{V}", f"{op_seconds * 1e6:.0f} us",
                 "parameter upload, launch, ids to the host"))


# ---- (b) models end to end -------------------------------------------------------------------------------

def generate(model, prompt: list[int], new_tokens: int, block_size: int = 16):
    """(greedy tokens, logits of the prompt and of every step) with host argmax."""
    table = list(range(-(-(len(prompt) + new_tokens) // block_size)))
    cache = model.new_kv_cache(len(table), block_size)
    batch = build_batch([ScheduledChunk(prompt, 0, table, True)], block_size)
    batch.logits_indices = np.arange(batch.num_tokens, dtype=np.int32)
    logits = [model.forward(batch, cache)]
    ids = list(prompt) + [int(logits[0][-1].argmax())]
    while len(ids) < len(prompt) + new_tokens:
        logits.append(model.forward(build_batch([ScheduledChunk(ids[-1:], len(ids) - 1, table, True)], block_size), cache))
        ids.append(int(logits[-1][0].argmax()))
    return ids[len(prompt):], np.concatenate(logits)


def generate_sampled_on_device(model, prompt: list[int], new_tokens: int, block_size: int = 16) -> list[int]:
    """Greedy tokens through forward(device_logits=True) and the model's own sampler (the engine's loop)."""
    table = list(range(-(-(len(prompt) + new_tokens) // block_size)))
    cache = model.new_kv_cache(len(table), block_size)
    sampler, greedy = model.new_sampler(), SamplingParams(temperature=0, max_tokens=new_tokens)
    ids, chunk = list(prompt), ScheduledChunk(prompt, 0, table, True)
    while len(ids) < len(prompt) + new_tokens:
        logits = model.forward(build_batch([chunk], block_size), cache, device_logits=True)
        ids.append(int(sampler.sample(logits, [greedy], [None], [prompt], [ids[len(prompt):]]).token_ids[0]))
        chunk = ScheduledChunk(ids[-1:], len(ids) - 1, table, True)
    return ids[len(prompt):]


def build_model(path: Path, ops):
    from minisarathi.config import ModelConfig
    from minisarathi.model.llama import LlamaModel
    from minisarathi.model.loader import load_weights
    config = ModelConfig.from_pretrained(path)
    return LlamaModel(config, load_weights(path, config), ops)


def random_model_dir() -> Path:
    """A random-weight Llama (GQA 4, head_dim 64, 4 layers) written as a Hugging Face folder."""
    from safetensors.numpy import save_file
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-model-"))
    H, L, Hq, Hk, D, I, V = 512, 4, 8, 2, 64, 1376, 2048
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "num_hidden_layers": L,
              "num_attention_heads": Hq, "num_key_value_heads": Hk, "head_dim": D, "intermediate_size": I,
              "vocab_size": V, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    tensors = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": 1 + 0.1 * w(H), "lm_head.weight": w(V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": 1 + 0.1 * w(H), p + "post_attention_layernorm.weight": 1 + 0.1 * w(H),
                        p + "self_attn.q_proj.weight": w(Hq * D, H), p + "self_attn.k_proj.weight": w(Hk * D, H),
                        p + "self_attn.v_proj.weight": w(Hk * D, H), p + "self_attn.o_proj.weight": w(H, Hq * D),
                        p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H),
                        p + "mlp.down_proj.weight": w(H, I)})
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def check_models(work: Path) -> None:
    rng = np.random.default_rng(1)
    for label, make_path, prompt in [("stories260K", default_model_dir, [1, 403, 407, 261, 378]),
                                     ("random 4-layer GQA", random_model_dir, rng.integers(3, 2048, 300).tolist())]:
        guarded(f"model {label}", check_model, label, make_path(), prompt)
    guarded("engine overlap", check_engine_overlap)


def check_engine_overlap() -> None:
    """The engine on the GPU (stories260K, 8 requests decoding together) with overlap off and on: the same
    tokens and logprobs (greedy, seeded, stopped by a token while the next step was in flight), and each decode
    step's host time against its wait for the sampled ids (docs/performance.md, "Overlap"). Both run decode
    steps as CUDA graphs (the default); a first, eager run (no graphs, no overlap) checks the graphs' tokens."""
    from minisarathi.engine.engine import LLMEngine
    kinds = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=24, logprobs=2),
             SamplingParams(temperature=1.0, seed=5, max_tokens=24, stop_token_ids=list(range(300, 360)))]
    results, rows = {}, []
    settings = {"eager": dict(overlap=False, cuda_graphs=False), "off": dict(overlap=False), "on": dict(overlap=True)}
    for name, options in settings.items():
        engine = LLMEngine(device="cuda", num_kv_blocks=256, **options)
        for i in range(8):
            engine.add_request(str(i), [1, 403 + i, 407, 261, 378], kinds[i % 3])
        finals = {}
        while engine.has_unfinished_requests():
            finals |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
        results[name] = {rid: (c.token_ids, c.finish_reason, [sorted(lp) for lp in c.logprobs or []])
                         for rid, c in finals.items()}
        if name == "eager":
            continue
        decode = [r for r in engine.step_records if r.num_prefill_tokens == 0]
        host, wait, step = (1e3 * float(np.mean([getattr(r, f) for r in decode]))
                            for f in ("host_time", "ids_wait_time", "step_time"))
        rows.append((f"  host / ids wait per step, engine bs=8 overlap {name}",
                     f"{host:.2f} ms", f"+ {wait:.2f} ms waiting for ids = {step:.2f} ms per decode step"))
    stops = sum(reason == "stop" for _, reason, _ in results["on"].values())
    same = results["off"] == results["on"]
    ROWS.append(("engine overlap on == off", "ok" if same else "MISMATCH",
                 f"tokens, logprob ids, finish reasons of 8 requests ({stops} stopped by a token)"))
    # A mismatch: a graph read a stale input, or (padding rows change the matmuls' shapes, and cuBLAS may then
    # pick other kernels) last-bit differences flipped a near tie.
    ROWS.append(("engine CUDA graphs == eager", "ok" if results["eager"] == results["off"] else "MISMATCH",
                 "the same 8 requests, decode steps replayed as graphs against every step eager"))
    ROWS.extend(rows)


def check_model(label: str, path: Path, prompt: list[int]) -> None:
    ref_ids, ref_logits = generate(build_model(path, NumpyOps()), prompt, 24)
    model = build_model(path, cuda_ops.gpu("float32"))
    ids, logits = generate(model, prompt, 24)
    same = ids == ref_ids
    ROWS.append((f"model {label} fp32", "ok" if same else "MISMATCH",
                 f"tokens {'identical' if same else 'differ'}, logits max err {np.abs(logits - ref_logits).max():.1e}"))
    on_device = generate_sampled_on_device(model, prompt, 24)
    ROWS.append((f"model {label} fp32, GpuSampler", "ok" if on_device == ref_ids else "MISMATCH",
                 "greedy tokens sampled on the device " + ("identical" if on_device == ref_ids else "differ")))
    bf16_model = build_model(path, cuda_ops.gpu("bfloat16"))
    _, bf16_logits = generate(bf16_model, prompt, 1)
    first = ref_logits[:len(bf16_logits)]
    error = float(np.abs(bf16_logits - first).max() / np.abs(first).max())
    ROWS.append((f"model {label} bf16", "ok" if error <= 0.06 else "MISMATCH", f"prefill logits rel err {error:.3f}"))
    host_ids, _ = generate(bf16_model, prompt, 8)
    device_ids = generate_sampled_on_device(bf16_model, prompt, 8)
    ROWS.append((f"model {label} bf16, GpuSampler", "ok" if host_ids == device_ids else "MISMATCH",
                 "bf16 logits: device greedy == host argmax" if host_ids == device_ids else f"{device_ids} vs {host_ids}"))
    log(f"  {label}: fp32 tokens {ids[:8]}... ref {ref_ids[:8]}..., bf16 rel err {error:.3f}")


# ---- (c) speed ----------------------------------------------------------------------------------------------

def measure_ceilings(work: Path) -> None:
    import cupy
    ceilings = {}
    a = cupy.empty(1 << 30, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    seconds = timed(lambda: cupy.copyto(b, a))
    ceilings["copy_bytes_per_s"] = 2 * a.nbytes / seconds   # read + write
    ops = cuda_ops.gpu("bfloat16")
    n = 8192
    x, w = random_device(ops, (n, n)), random_device(ops, (n, n))
    seconds = timed(lambda: ops.linear(x, w), repeat=10)
    ceilings["bf16_flop_per_s"] = 2 * n ** 3 / seconds
    (work / "ceilings.json").write_text(json.dumps(ceilings))
    ROWS.append(("ceiling device copy", f"{ceilings['copy_bytes_per_s'] / 1e9:.0f} GB/s", "1 GiB cupy.copyto, read+write"))
    ROWS.append(("ceiling bf16 matmul", f"{ceilings['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s", "8192^3 cublasGemmEx"))


def ceiling(work: Path, name: str) -> float | None:
    path = work / "ceilings.json"
    return json.loads(path.read_text()).get(name) if path.exists() else None


def bandwidth_row(work: Path, name: str, seconds: float, nbytes: float, target: float | None = None) -> None:
    path = work / "ceilings.json"
    copy = json.loads(path.read_text())["copy_bytes_per_s"] if path.exists() else None
    rate = nbytes / seconds
    share = f"{100 * rate / copy:.0f}% of copy" if copy else "no ceiling"
    verdict = "" if target is None or not copy else (" (target met)" if rate >= target * copy else f" (target {target:.0%})")
    ROWS.append((f"speed {name}", f"{seconds * 1e6:.0f} us", f"{rate / 1e9:.0f} GB/s, {share}{verdict}"))


def time_kernels(work: Path) -> None:
    ops = cuda_ops.gpu("bfloat16")
    H, Hq, Hk, D, I = 4096, 32, 8, 128, 14336
    table = random_device(ops, (128256, H))
    cos_sin = ops.constant(rope_cos_sin_table((1.0 / 500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32), 8192))
    for T in (1, 512):
        x, r, w = random_device(ops, (T, H)), random_device(ops, (T, H)), random_device(ops, (H,))
        bandwidth_row(work, f"rms_norm T={T}", timed(lambda: ops.rms_norm(x, w, 1e-5)), 2 * x.nbytes)
        bandwidth_row(work, f"add_rms_norm T={T}", timed(lambda: ops.add_rms_norm(x, r, w, 1e-5)), 4 * x.nbytes)
        g = random_device(ops, (T, 2 * I))
        bandwidth_row(work, f"silu_and_mul T={T}", timed(lambda: ops.silu_and_mul(g)), 1.5 * g.nbytes)
        qkv = random_device(ops, (T, (Hq + 2 * Hk) * D))
        q, k, v = (qkv[:, :Hq * D].reshape(T, Hq, D), qkv[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D),
                   qkv[:, (Hq + Hk) * D:].reshape(T, Hk, D))
        k_cache, v_cache = random_device(ops, (T // 16 + 1, Hk, 16, D)), random_device(ops, (T // 16 + 1, Hk, 16, D))
        positions, slots = np.arange(T, dtype=np.int32), np.arange(T, dtype=np.int32)
        bandwidth_row(work, f"rope_store_kv T={T}", timed(lambda: ops.rope_store_kv(
            q, k, v, k_cache, v_cache, positions, slots, cos_sin)), 2 * qkv.nbytes)   # read Q, K, V; write Q, K, V
        ids = np.arange(T, dtype=np.int32)
        bandwidth_row(work, f"embedding T={T}", timed(lambda: ops.embedding(table, ids)), 2 * T * H * 2)


# ---- (d) attention alone: issue 10's shapes ----------------------------------------------------------------
# Llama-3-8B-shaped attention (32 query / 8 KV heads, head_dim 128, bf16, blocks of 16). Every row calls the
# backend's attention op (ops.paged_attention), so it measures whichever kernels the backend chooses for the
# shape: the attention kernels of issue 10 show up here as they land, with no change to this section.
ATTENTION_CASES = [  # label, (history tokens, new tokens) per sequence, target (fraction of a ceiling)
    ("prefill 2048 @0", [(0, 2048)], 350e12), ("prefill 2048 @8k", [(8192, 2048)], 350e12),
    ("prefill 2048 @30k", [(30720, 2048)], 350e12),
    ("decode 64x4k", [(4095, 1)] * 64, 0.80), ("decode 1x512", [(511, 1)], None), ("decode 1x32k", [(32767, 1)], 0.60),
]


def time_attention(work: Path) -> None:
    ops = cuda_ops.gpu("bfloat16")
    for label, runs, target in ATTENTION_CASES:
        guarded(f"attention {label}", time_attention_case, work, ops, label, runs, target)


def time_attention_case(work: Path, ops, label: str, runs: list[tuple[int, int]], target) -> None:
    Hq, Hk, D, bs = 32, 8, 128, 16
    blocks = [-(-(history + n) // bs) for history, n in runs]
    chunks, first = [], 0
    for (history, n), count in zip(runs, blocks):
        chunks.append(ScheduledChunk([1] * n, history, list(range(first, first + count)), True))
        first += count
    batch = build_batch(chunks, bs)
    k_cache, v_cache = random_device(ops, (first, Hk, bs, D)), random_device(ops, (first, Hk, bs, D))
    q = random_device(ops, (batch.num_tokens, Hq, D))
    scale = D ** -0.5
    out = ops.paged_attention(q, k_cache, v_cache, batch, scale)
    seconds = timed(lambda: ops.paged_attention(q, k_cache, v_cache, batch, scale), repeat=10)
    # Error against NumPy on a sample, so the CPU reference stays seconds: a chunk's last 32 query rows
    # (over its whole history), or a decode batch's first two sequences.
    history, n = runs[0]
    if n > 1:
        m = min(32, n)
        sample, rows, used = build_batch([ScheduledChunk([1] * m, history + n - m, chunks[0].block_table, True)], bs), \
            slice(n - m, n), blocks[0]
    else:
        sample, rows, used = build_batch(chunks[:2], bs), slice(0, min(2, len(runs))), sum(blocks[:2])
    want = NumpyOps().paged_attention(ops.to_numpy(q[rows]), ops.to_numpy(k_cache[:used]), ops.to_numpy(v_cache[:used]),
                                     sample, scale)
    error = float(np.abs(ops.to_numpy(out[rows]) - want).max() / max(1.0, np.abs(want).max()))
    verdict = "MISMATCH" if not error <= TOLERANCE["bfloat16"] else None
    if n > 1:
        flops = 4 * D * Hq * sum(n * h + n * (n + 1) // 2 for h, n in runs)
        matmul = ceiling(work, "bf16_flop_per_s")
        share = f", {100 * flops / seconds / matmul:.0f}% of bf16 matmul" if matmul else ""
        met = "" if not target else (" (target met)" if flops / seconds >= target else f" (target {target / 1e12:.0f})")
        ROWS.append((f"attention {label}", verdict or f"{seconds * 1e6:.0f} us",
                     f"{flops / seconds / 1e12:.1f} TFLOP/s{share}{met}; err {error:.1e}"))
    else:
        kv_bytes = 2 * sum(h + 1 for h, _ in runs) * Hk * D * 2
        bandwidth_row(work, f"attention {label}", seconds, kv_bytes, target)
        ROWS[-1] = (ROWS[-1][0], verdict or ROWS[-1][1], f"{ROWS[-1][2]}; err {error:.1e}")


# ---- (e) a Llama-3-8B-shaped model: prefill chunk, decode steps, host against GPU time, CUDA graphs -------------

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
             "eos_token_id": 2}


class WeightShape:
    """Stands in for a checkpoint tensor: random_8b_model's ops.weight reads only the shape."""

    def __init__(self, *shape: int):
        self.shape = shape


def random_8b_model():
    """(LlamaModel, ops): Llama-3-8B's shapes in bf16 with random weights made on the GPU (about 16 GB)."""
    from minisarathi.config import ModelConfig
    from minisarathi.model.llama import LlamaModel
    config = ModelConfig.from_dict(LLAMA3_8B)
    ops = cuda_ops.gpu("bfloat16")
    ops.weight = lambda w: random_device(ops, w.shape, w.shape[-1] ** -0.5 if len(w.shape) == 2 else 1.0)
    H, I, V, D = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    Hq, Hk = config.num_attention_heads, config.num_key_value_heads
    weights = {"embed_tokens": WeightShape(V, H), "norm": WeightShape(H), "lm_head": WeightShape(V, H)}
    for i in range(config.num_hidden_layers):
        weights |= {f"layers.{i}.input_layernorm": WeightShape(H), f"layers.{i}.qkv_proj": WeightShape((Hq + 2 * Hk) * D, H),
                    f"layers.{i}.o_proj": WeightShape(H, Hq * D), f"layers.{i}.post_attention_layernorm": WeightShape(H),
                    f"layers.{i}.gate_up_proj": WeightShape(2 * I, H), f"layers.{i}.down_proj": WeightShape(H, I)}
    return LlamaModel(config, weights, ops), ops


def host_and_device_seconds(fn, repeat: int = 20) -> tuple[float, float]:
    """Medians of (host seconds to issue fn(), device seconds between events around it). When the host is
    the slower one, the device waits for it and the event time is about the host time."""
    import cupy
    fn()
    cupy.cuda.get_current_stream().synchronize()
    host, device = [], []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        begin = time.perf_counter()
        fn()
        host.append(time.perf_counter() - begin)
        end.record()
        end.synchronize()
        device.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(host)), float(np.median(device))


def time_model_8b(work: Path) -> None:
    import cupy
    model, ops = random_8b_model()
    c = model.config
    L, H, I, V, D = c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    Hq, Hk, bs = c.num_attention_heads, c.num_key_value_heads, 16
    decodes = {1: 512, 64: 1024}                         # batch -> context
    prefill_blocks = 2048 // bs
    num_blocks = prefill_blocks + sum(S * ctx // bs for S, ctx in decodes.items())
    cache = model.new_kv_cache(num_blocks, bs)
    for k_cache, v_cache in cache:                       # never time attention over zeros
        k_cache[...] = random_device(ops, k_cache.shape)
        v_cache[...] = random_device(ops, v_cache.shape)
    weight_bytes = sum(getattr(layer, f).nbytes for layer in model.layers for f in layer.__dataclass_fields__
                       if getattr(layer, f) is not None) + model.lm_head.nbytes + model.norm.nbytes
    matmul_params = (Hq + 2 * Hk) * D * H + H * Hq * D + 3 * H * I

    prefill = build_batch([ScheduledChunk([7] * 2048, 0, list(range(prefill_blocks)), True)], bs)
    seconds = timed(lambda: model.forward(prefill, cache, device_logits=True), repeat=5)
    flops = L * (2 * 2048 * matmul_params + 4 * D * Hq * 2048 * 2049 // 2) + 2 * H * V
    matmul = ceiling(work, "bf16_flop_per_s")
    ROWS.append(("model-8b prefill chunk 2048", f"{seconds * 1e3:.1f} ms",
                 f"{flops / seconds / 1e12:.0f} TFLOP/s" + (f", {100 * flops / seconds / matmul:.0f}% of bf16 matmul"
                                                            if matmul else "")))

    first = prefill_blocks
    for S, ctx in decodes.items():
        chunks = [ScheduledChunk([5], ctx - 1, list(range(first + s * ctx // bs, first + (s + 1) * ctx // bs)), True)
                  for s in range(S)]
        first += S * ctx // bs
        batch = build_batch(chunks, bs)
        step = lambda: model.forward(batch, cache, device_logits=True)   # noqa: E731
        host, device = host_and_device_seconds(step)
        kv_bytes = 2 * S * ctx * L * Hk * D * 2
        bandwidth_row(work, f"model-8b decode bs={S} @{ctx}", device, weight_bytes + kv_bytes,
                      target=0.85 if S == 1 else 0.75)
        ROWS.append((f"  host / GPU per step bs={S} eager", f"{host * 1e3:.2f} ms", f"GPU (events) {device * 1e3:.2f} ms"))
        q = random_device(ops, (S, Hq, D))
        k_cache, v_cache = cache[0]
        attention = timed(lambda: ops.paged_attention(q, k_cache, v_cache, batch, D ** -0.5))
        ROWS.append((f"  attention share bs={S}", f"{100 * L * attention / device:.0f}%",
                     f"{L} x {attention * 1e6:.0f} us of {device * 1e3:.2f} ms"))
        # The same step as the engine runs it with CUDA graphs on (minisarathi/model/decode_graphs.py): padded
        # to its bucket, decode attention planned for the model's whole context (as the engine plans it with
        # the default max_model_len), captured at its first call, then the upload and a replay per step.
        model.use_decode_buckets(max_num_seqs=64, max_model_len=c.max_position_embeddings, block_size=bs,
                                 capture=True)
        begin = time.perf_counter()
        step()
        cupy.cuda.get_current_stream().synchronize()
        first_step = time.perf_counter() - begin
        host, device = host_and_device_seconds(step)
        model.decode_graphs = None
        ROWS.append((f"  host / GPU per step bs={S} graph", f"{host * 1e3:.3f} ms",
                     f"GPU (replay) {device * 1e3:.2f} ms; first step (eager + capture) {first_step * 1e3:.0f} ms"))


# ---- (f) compute-sanitizer over one small forward (optional, time-boxed) -------------------------------------

def run_sanitizer(work: Path) -> None:
    """memcheck and racecheck over small_forward(). Optional: some GPU runtimes refuse the sanitizer ("Device
    not supported"); that, a missing tool or a time-out is an n/a row that costs seconds, not the run."""
    exe = shutil.which("compute-sanitizer") or next(
        (str(p) for p in (Path("/usr/local/cuda/bin/compute-sanitizer"),) if p.exists()), None)
    if exe is None:
        ROWS.append(("compute-sanitizer", "n/a", "not installed"))
        return
    for tool, limit in (("memcheck", 20), ("racecheck", 20)):
        try:
            result = subprocess.run([exe, "--tool", tool, "--error-exitcode", "3", sys.executable, __file__,
                                     "--small-forward"], capture_output=True, text=True, timeout=limit, cwd=REPO)
        except subprocess.TimeoutExpired:
            ROWS.append((f"compute-sanitizer {tool}", "n/a", f"time-boxed at {limit} s (optional)"))
            continue
        text = result.stdout + result.stderr
        log(f"[compute-sanitizer {tool}, exit {result.returncode}]\n{text[-3000:]}")
        refusal = next((line for line in text.splitlines() if "not supported" in line.lower()), None)
        if refusal:
            ROWS.append(("compute-sanitizer", "n/a", f"refused: {refusal.strip()[:80]}"))
            return
        summary = next((line.strip() for line in text.splitlines() if "SUMMARY" in line), f"exit code {result.returncode}")
        verdict = {0: "ok", 3: "ERROR"}.get(result.returncode, "n/a")
        ROWS.append((f"compute-sanitizer {tool}", verdict, summary[:90]))


def small_forward() -> None:
    """The bundled model in float32 on the GPU: a prompt, three tokens sampled on the device, and a top-k/top-p
    draw: every kernel launches at least once."""
    from minisarathi.backends.gpu_sampling import GpuSampler
    model = build_model(default_model_dir(), cuda_ops.gpu("float32"))
    ids = generate_sampled_on_device(model, [1, 403, 407, 261, 378], 3)
    ops = model.ops
    logits = ops.launcher.to_device(np.random.default_rng(0).standard_normal((4, 1000)).astype(np.float32))
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01)] * 4
    drawn = GpuSampler(ops, 1000).sample(logits, params, [None] * 4, [[1]] * 4, [[]] * 4).token_ids
    print("small forward:", ids, drawn.tolist(), flush=True)


# ---- (h) tensor parallelism over NCCL: two GPUs against one (docs/deploy.md) ---------------------------------

def check_nccl(work: Path) -> None:
    """The bundled model split over two GPUs (a rank process per GPU, all-reduces through NCCL) against the same
    model on one: greedy tokens identical, logits within float32 tolerance, and a decode step's time. With one
    GPU it says so and passes: the communicator itself is then covered by a one-rank test where NCCL exists."""
    import cupy
    count = cupy.cuda.runtime.getDeviceCount()
    if count < 2:
        ROWS.append(("nccl TP=2", "skipped: one GPU", f"{count} GPU visible; TP over NCCL needs two"))
        return
    from cupy.cuda import nccl
    from minisarathi.parallel.group import TensorParallelModel, find_mpiexec
    if not nccl.available:
        ROWS.append(("nccl TP=2", "MISSING", "NCCL is not loadable by CuPy: pip install 'nvidia-nccl-cu13' (or -cu12)"))
        return
    try:
        find_mpiexec()
    except ValueError as exc:
        ROWS.append(("nccl TP=2", "MISSING", str(exc)))
        return
    path, prompt, new_tokens = default_model_dir(), [1, 403, 407, 261, 378], 24
    one = build_model(path, cuda_ops.gpu("float32"))
    want_ids, want_logits = generate(one, prompt, new_tokens)
    one_s = seconds_per_token(one, prompt, new_tokens)
    two = TensorParallelModel(path, "cuda", "float32", 2, rank_timeout_s=15)
    try:
        ids, logits = generate(two, prompt, new_tokens)
        two_s = seconds_per_token(two, prompt, new_tokens)
    finally:
        two.close()
    error = float(np.abs(logits - want_logits).max() / np.abs(want_logits).max())
    ok = ids == want_ids and error <= TOLERANCE["float32"]
    ROWS.append(("nccl TP=2 vs TP=1 stories260K fp32", "ok" if ok else "MISMATCH",
                 f"greedy tokens {'identical' if ids == want_ids else 'differ'}, logits rel err {error:.1e}"))
    ROWS.append(("speed nccl TP=2 token", f"{two_s * 1e3:.2f} ms", f"TP=1 {one_s * 1e3:.2f} ms; host loop, {new_tokens} tokens"))


def seconds_per_token(model, prompt: list[int], new_tokens: int) -> float:
    """Wall time of generate() per token, prefill included (the first run compiled and warmed up)."""
    start = time.perf_counter()
    generate(model, prompt, new_tokens)
    return (time.perf_counter() - start) / new_tokens


def run_pytest(work: Path) -> None:
    gpu_tests = ["test_bundled_model_on_gpu", "test_bf16_checkpoint_reaches_the_backend_as_its_own_bits[gpu]",
                 "test_gpu_sampler_matches_the_numpy_sampler[gpu-bfloat16]"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-rs", *[f"tests/test_cuda_backend.py::{t}" for t in gpu_tests],
                             "tests/test_nvrtc.py"], capture_output=True, text=True, timeout=30, cwd=REPO)
    log(f"[pytest output]\n{result.stdout}{result.stderr}")
    summary = (result.stdout.strip().splitlines() or ["no output"])[-1]
    # On a GPU nothing may skip: a skip means CuPy or NVRTC was not usable from pytest.
    verdict = "FAILED" if result.returncode else "SKIPPED" if "skipped" in summary else "ok"
    ROWS.append(("pytest GPU tests + nvrtc", verdict, summary[:90]))


# name -> (check, seconds it may take), in the order they run: correctness first, speed second, the optional
# sanitizer pass, pytest, then NCCL last (its rank processes are the likeliest to outlive a killed section). The limits add up to less than TOTAL_BUDGET_S (tests/test_gpu_check.py).
SECTIONS = {"kernels": (check_kernels, 45), "sampling": (check_sampling, 30), "models": (check_models, 45),
            "ceilings": (measure_ceilings, 20), "kernel-speed": (time_kernels, 30),
            "attention": (time_attention, 45), "model-8b": (time_model_8b, 75),
            "sanitizer": (run_sanitizer, 45), "pytest": (run_pytest, 35), "nccl": (check_nccl, 20)}


def run_section(name: str, out: Path, work: Path) -> None:
    """In a child process: one section, its rows to WORK/rows/NAME.json, its log appended to OUT/details.txt."""
    start = time.perf_counter()
    guarded(name, SECTIONS[name][0], work)
    log(f"[{name}] {time.perf_counter() - start:.1f} s")
    (work / "rows" / f"{name}.json").write_text(json.dumps(ROWS))
    with open(out / "details.txt", "a") as details:
        details.write("\n".join(DETAILS) + "\n")


def preflight() -> str | None:
    """None when CuPy imports and sees a GPU; otherwise what is missing, and what to install."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not importable ({exc}); {INSTALL_HINT}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:   # no driver: CUDARuntimeError
        return f"no CUDA GPU usable by CuPy {cupy.__version__}: {str(exc).splitlines()[0][:120]}"
    return None if count else f"no CUDA GPU visible to CuPy {cupy.__version__}"


def run_all(out: Path, work: Path) -> int:
    """Every section in its own process within TOTAL_BUDGET_S; 1 if any check failed, 2 if nothing could run."""
    (work / "rows").mkdir(parents=True, exist_ok=True)
    (out / "details.txt").write_text("")
    missing = preflight()
    if missing:
        rows = [("environment", "MISSING", missing)]
        write_summary(out, work, rows)
        print("\n" + table(rows), flush=True)
        return 2
    deadline = time.monotonic() + TOTAL_BUDGET_S
    rows: list[tuple[str, str, str]] = []
    for name, (_, limit) in SECTIONS.items():
        rows_file = work / "rows" / f"{name}.json"
        rows_file.unlink(missing_ok=True)
        left = deadline - time.monotonic()
        if left < 15:
            rows.append((name, "SKIPPED", f"{TOTAL_BUDGET_S} s budget spent"))
            continue
        print(f"==== {name} (limit {min(limit, left):.0f} s)", flush=True)
        try:
            code = subprocess.run([sys.executable, __file__, "--out", str(out), "--work", str(work), "--section", name],
                                  timeout=min(limit, left), cwd=REPO).returncode
        except subprocess.TimeoutExpired:
            code = f"killed after {min(limit, left):.0f} s"
        rows += [tuple(row) for row in json.loads(rows_file.read_text())] if rows_file.exists() else []
        if code != 0:
            rows.append((name, "ERROR", f"section process: {code if isinstance(code, str) else f'exit code {code}'}"))
        write_summary(out, work, rows)
    print("\n" + table(rows), flush=True)
    return int(any(result in FAILURES for _, result, _ in rows))


def table(rows) -> str:
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:{width}s}  {result:>14s}  {detail}" for name, result, detail in rows)


def write_summary(out: Path, work: Path, rows) -> None:
    ceilings = work / "ceilings.json"
    (out / "summary.txt").write_text(table(rows) + "\n")
    (out / "results.json").write_text(json.dumps(
        {"rows": rows, "ceilings": json.loads(ceilings.read_text()) if ceilings.exists() else {}}, indent=1))


# ---- nvcc resource report (no GPU needed) --------------------------------------------------------------------

def ptxas_report(arch: str = "sm_90") -> str:
    """Markdown table of registers, shared memory and spills per kernel instantiation, from nvcc -Xptxas -v."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    lines = ["| kernel | registers | static smem (B) | spill stores/loads (B) |", "| --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        for file in cuda_ops.kernel_files():
            names = cuda_ops.name_expressions(file)
            # Taking each kernel's address instantiates the templates, as NVRTC's name expressions do.
            wrapper = Path(tmp) / f"{Path(file).stem}_all.cu"
            wrapper.write_text(f'#include "{cuda_dir() / file}"\n' +
                               "".join(f"void* kernel_{i} = (void*)&{n};\n" for i, n in enumerate(names)))
            result = subprocess.run([nvcc, "--cubin", f"-arch={arch}", "-std=c++17", f"-I{cuda_dir()}",
                                     "-Xptxas", "-v,-warn-spills", "-o", str(Path(tmp) / "out.cubin"), str(wrapper)],
                                    capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(result.stderr)
            lowered = {}
            for block in re.split(r"ptxas info\s+: Compiling entry function ", result.stderr)[1:]:
                mangled = block.split("'")[1]
                regs = re.search(r"Used (\d+) registers", block)
                smem = re.search(r"(\d+) bytes smem", block)
                spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
                lowered[mangled] = (regs.group(1) if regs else "?", smem.group(1) if smem else "0",
                                    f"{spill.group(1)}/{spill.group(2)}" if spill else "?")
            for name in names:
                base, _, targ = name.partition("<")
                match = [m for m in lowered if m == name or (targ and m.startswith(f"_Z{len(base)}{base}")
                                                              and _mangled_type(targ[:-1]) in m)]
                regs, smem, spill = lowered[match[0]] if match else ("?", "?", "?")
                lines.append(f"| `{name}` | {regs} | {smem} | {spill} |")
    return "\n".join(lines)


def _mangled_type(cxx: str) -> str:
    """Itanium mangling of template arguments: an element type, then any int arguments (`__half, 16`)."""
    element, *ints = cxx.split(", ")
    code = {"float": "f", "__half": "6__half", "__nv_bfloat16": "13__nv_bfloat16"}[element]
    return "I" + code + "".join(f"Li{n}E" for n in ints) + "E"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="the few files to keep")
    parser.add_argument("--work", type=Path, help="scratch folder for rows and ceilings (default: a temporary one)")
    parser.add_argument("--section", choices=list(SECTIONS), help="run one section in this process")
    parser.add_argument("--small-forward", action="store_true", help="one small forward (what the sanitizer runs)")
    parser.add_argument("--ptxas-report", action="store_true", help="print the nvcc resource table and exit")
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    if args.ptxas_report:
        print(ptxas_report(args.arch))
        return
    if args.small_forward:
        small_forward()
        return
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = (args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))).resolve()
    if args.section:
        (work / "rows").mkdir(parents=True, exist_ok=True)
        run_section(args.section, out, work)
        return
    sys.exit(run_all(out, work))


if __name__ == "__main__":
    main()
