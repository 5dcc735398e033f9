"""The CUDA backend on a real GPU: correctness against NumPy, then speed against measured ceilings.

    python bench/gpu_check.py --out DIR        # what bench/gpu_check.sh runs (needs a GPU and CuPy)
    python bench/gpu_check.py --ptxas-report   # registers / shared memory / spills per kernel (nvcc, no GPU)

Each section runs on its own (an exception is recorded, the next section still runs). Details go to
DIR/details.txt and DIR/results.json; a short table is printed last.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minisarathi.backends import cuda_ops, numpy_ops  # noqa: E402
from minisarathi.backends.emulator.bf16 import bf16_to_float32, float32_to_bf16  # noqa: E402
from minisarathi.engine.batch import ScheduledChunk, build_batch  # noqa: E402
from minisarathi.paths import cuda_dir, default_model_dir  # noqa: E402

TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2}
ROWS: list[tuple[str, str, str]] = []   # (section, result, detail) for the final table
DETAILS: list[str] = []


def log(line: str) -> None:
    print(line, flush=True)
    DETAILS.append(line)


def section(name: str):
    def wrap(fn):
        def run(*args):
            start = time.perf_counter()
            try:
                fn(*args)
            except Exception:
                ROWS.append((name, "ERROR", traceback.format_exc().strip().splitlines()[-1][:90]))
                log(f"[{name}] failed:\n{traceback.format_exc()}")
            log(f"[{name}] {time.perf_counter() - start:.1f} s")
        return run
    return wrap


# ---- helpers -------------------------------------------------------------------------------------------

def host(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to dtype, as float32 (what the GPU sees)."""
    return bf16_to_float32(float32_to_bf16(x)) if dtype == "bfloat16" else x.astype(np.float32)


def compare(name: str, ops, got, want: np.ndarray, dtype: str) -> None:
    got = ops.to_numpy(got)
    scale = max(1.0, float(np.abs(want).max()))
    error = float(np.abs(got - want).max()) / scale
    ok = error <= TOLERANCE[dtype]
    ROWS.append((f"kernel {name} {dtype}", "ok" if ok else "MISMATCH", f"max error {error:.2e} of scale"))
    log(f"  {name:28s} {dtype:9s} error {error:.2e} {'ok' if ok else 'MISMATCH'}")


def timed(fn, repeat: int = 20) -> float:
    """Median seconds of fn() on the GPU, measured with CUDA events after a warm-up."""
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
    """Random activations/weights made on the GPU (fast even for an 8B-shaped model)."""
    import cupy
    x = cupy.random.standard_normal(shape, dtype=cupy.float32) * scale
    if ops.dtype != "bfloat16":
        return x.astype(ops.activation_dtype)
    bits = x.view(cupy.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cupy.uint16)


# ---- (a) kernels against NumPy -------------------------------------------------------------------------

@section("kernels vs numpy")
def check_kernels():
    rng = np.random.default_rng(0)
    for dtype in ("float32", "bfloat16"):
        ops = cuda_ops.gpu(dtype)
        x32, w32, r32 = (host(rng.standard_normal(s).astype(np.float32), dtype) for s in [(9, 1000), (1000,), (9, 1000)])
        x, w, r = ops.weight(x32), ops.weight(w32), ops.weight(r32)
        compare("rms_norm", ops, ops.rms_norm(x, w, 1e-5), numpy_ops.rms_norm(x32, w32, 1e-5), dtype)
        out, _ = ops.add_rms_norm(x, r, w, 1e-5)
        compare("add_rms_norm", ops, out, numpy_ops.add_rms_norm(x32, r32.copy(), w32, 1e-5)[0], dtype)
        compare("silu_and_mul", ops, ops.silu_and_mul(x), numpy_ops.silu_and_mul(x32), dtype)
        ids = np.array([0, 5, 999, 5], dtype=np.int32)
        table32 = host(rng.standard_normal((1000, 64)).astype(np.float32), dtype)
        compare("embedding", ops, ops.embedding(ops.weight(table32), ids), table32[ids], dtype)
        wl32 = host(rng.standard_normal((300, 1000)).astype(np.float32) * 0.05, dtype)
        b32 = host(rng.standard_normal(300).astype(np.float32), dtype)
        compare("linear+bias", ops, ops.linear(x, ops.weight(wl32), ops.weight(b32)), x32 @ wl32.T + b32, dtype)

        T, Hq, Hk, D = 7, 32, 8, 128
        qkv32 = host(rng.standard_normal((T, (Hq + 2 * Hk) * D)).astype(np.float32), dtype)
        qkv = ops.weight(qkv32)
        positions = np.array([0, 1, 2, 3, 100, 5000, 130000], dtype=np.int32)
        inv_freq = (1.0 / 500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32)
        ops.rope(qkv[:, :Hq * D].reshape(T, Hq, D), qkv[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D), positions, inv_freq)
        ref = qkv32.copy()
        numpy_ops.rope(ref[:, :Hq * D].reshape(T, Hq, D), ref[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D), positions, inv_freq)
        compare("rope (strided views)", ops, qkv, ref, dtype)

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
            compare(label, ops, got, numpy_ops.paged_attention(q32, k32, v32, batch, D ** -0.5), dtype)

            kn32 = host(rng.standard_normal((batch.num_tokens, Hk, D)).astype(np.float32), dtype)
            kc, vc = ops.weight(k32), ops.weight(v32)
            ops.store_kv(ops.weight(kn32), ops.weight(kn32), kc, vc, batch.slot_mapping)
            kref, vref = k32.copy(), v32.copy()
            numpy_ops.store_kv(kn32, kn32, kref, vref, batch.slot_mapping)
            compare("store_kv", ops, kc, kref, dtype)

    ops = cuda_ops.gpu("float32")
    logits = rng.standard_normal((5, 128256)).astype(np.float32)
    ok = np.array_equal(ops.greedy(ops.launcher.to_device(logits)), logits.argmax(1))
    ROWS.append(("kernel greedy argmax", "ok" if ok else "MISMATCH", "128256-token vocab"))
    ids, _ = ops.sample(ops.launcher.to_device(logits), [0.0, 1.0, 0.8, 1.0, 1.0], [0, 0, 50, 0, 0],
                        [1.0, 1.0, 1.0, 0.9, 1.0], [0.0, 0.0, 0.0, 0.0, 0.1], [0.5, 0.3, 0.7, 0.2, 0.9])
    valid = ids[0] == logits[0].argmax() and np.all((ids >= 0) & (ids < logits.shape[1]))
    ROWS.append(("kernel sample", "ok" if valid else "MISMATCH", f"ids {ids.tolist()}"))


# ---- (b) models end to end -------------------------------------------------------------------------------

def generate(model, prompt: list[int], new_tokens: int, block_size: int = 16):
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


def build_model(path: Path, ops):
    from minisarathi.config import ModelConfig
    from minisarathi.model.llama import LlamaModel
    from minisarathi.model.loader import load_weights
    config = ModelConfig.from_pretrained(path)
    model = LlamaModel(config, load_weights(path, config), ops)
    model.inv_freq = config.rope_inv_freq()   # float32 whatever the activation dtype
    return model


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


@section("models end to end")
def check_models():
    rng = np.random.default_rng(1)
    for label, path, prompt in [("stories260K", default_model_dir(), [1, 403, 407, 261, 378]),
                                ("random 4-layer GQA", random_model_dir(), rng.integers(3, 2048, 300).tolist())]:
        ref_ids, ref_logits = generate(build_model(path, numpy_ops), prompt, 24)
        ids, logits = generate(build_model(path, cuda_ops.gpu("float32")), prompt, 24)
        same = ids == ref_ids
        ROWS.append((f"model {label} fp32", "ok" if same else "MISMATCH",
                     f"tokens {'identical' if same else 'differ'}, logits max err {np.abs(logits - ref_logits).max():.1e}"))
        _, bf16_logits = generate(build_model(path, cuda_ops.gpu("bfloat16")), prompt, 1)
        first = ref_logits[:len(bf16_logits)]
        error = float(np.abs(bf16_logits - first).max() / np.abs(first).max())
        ROWS.append((f"model {label} bf16", "ok" if error <= 0.05 else "MISMATCH", f"prefill logits rel err {error:.3f}"))
        log(f"  {label}: fp32 tokens {ids[:8]}... ref {ref_ids[:8]}..., bf16 rel err {error:.3f}")


# ---- (c) speed ----------------------------------------------------------------------------------------------

CEILINGS: dict[str, float] = {}


@section("ceilings")
def measure_ceilings():
    import cupy
    a = cupy.empty(1 << 30, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    seconds = timed(lambda: cupy.copyto(b, a))
    CEILINGS["copy_bytes_per_s"] = 2 * a.nbytes / seconds   # read + write
    ops = cuda_ops.gpu("bfloat16")
    n = 8192
    x, w = random_device(ops, (n, n)), random_device(ops, (n, n))
    seconds = timed(lambda: ops.linear(x, w), repeat=10)
    CEILINGS["bf16_flop_per_s"] = 2 * n ** 3 / seconds
    ROWS.append(("ceiling device copy", f"{CEILINGS['copy_bytes_per_s'] / 1e9:.0f} GB/s", "1 GiB cupy.copyto, read+write"))
    ROWS.append(("ceiling bf16 matmul", f"{CEILINGS['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s", "8192^3 cublasGemmEx"))


def bandwidth_row(name: str, seconds: float, nbytes: float, target: float | None = None) -> None:
    rate = nbytes / seconds
    copy = CEILINGS.get("copy_bytes_per_s")
    share = f"{100 * rate / copy:.0f}% of copy" if copy else "no ceiling"
    verdict = "" if target is None or not copy else (" (target met)" if rate >= target * copy else f" (target {target:.0%})")
    ROWS.append((f"speed {name}", f"{seconds * 1e6:.0f} us", f"{rate / 1e9:.0f} GB/s, {share}{verdict}"))


@section("kernel speed (Llama-3-8B shapes, bf16)")
def time_kernels():
    import cupy
    ops = cuda_ops.gpu("bfloat16")
    H, Hq, Hk, D, I = 4096, 32, 8, 128, 14336
    for T in (1, 512):
        x, r, w = random_device(ops, (T, H)), random_device(ops, (T, H)), random_device(ops, (H,))
        bandwidth_row(f"rms_norm T={T}", timed(lambda: ops.rms_norm(x, w, 1e-5)), 2 * x.nbytes)
        bandwidth_row(f"add_rms_norm T={T}", timed(lambda: ops.add_rms_norm(x, r, w, 1e-5)), 4 * x.nbytes)
        g = random_device(ops, (T, 2 * I))
        bandwidth_row(f"silu_and_mul T={T}", timed(lambda: ops.silu_and_mul(g)), 1.5 * g.nbytes)
        qkv = random_device(ops, (T, (Hq + 2 * Hk) * D))
        q, k = qkv[:, :Hq * D].reshape(T, Hq, D), qkv[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D)
        positions = np.arange(T, dtype=np.int32)
        inv_freq = (1.0 / 500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32)
        bandwidth_row(f"rope T={T}", timed(lambda: ops.rope(q, k, positions, inv_freq)), 2 * (q.size + k.size) * 2)
        ids = np.arange(T, dtype=np.int32)
        table = random_device(ops, (128256, H))
        bandwidth_row(f"embedding T={T}", timed(lambda: ops.embedding(table, ids)), 2 * T * H * 2)
        v = qkv[:, (Hq + Hk) * D:].reshape(T, Hk, D)
        k_cache, v_cache = ops.zeros((T // 16 + 1, Hk, 16, D)), ops.zeros((T // 16 + 1, Hk, 16, D))
        slots = np.arange(T, dtype=np.int32)
        bandwidth_row(f"store_kv T={T}", timed(lambda: ops.store_kv(k, v, k_cache, v_cache, slots)), 2 * 2 * k.size * 2)

    # Decode attention: 64 sequences at 4096 tokens of context, blocks of 16.
    S, ctx, bs = 64, 4096, 16
    blocks = ctx // bs
    chunks = [ScheduledChunk([1], ctx - 1, list(range(s * blocks, (s + 1) * blocks)), True) for s in range(S)]
    batch = build_batch(chunks, bs)
    k_cache, v_cache = random_device(ops, (S * blocks, Hk, bs, D)), random_device(ops, (S * blocks, Hk, bs, D))
    q = random_device(ops, (S, Hq, D))
    seconds = timed(lambda: ops.paged_attention(q, k_cache, v_cache, batch, D ** -0.5))
    bandwidth_row("paged_attention decode 64x4k", seconds, k_cache.nbytes + v_cache.nbytes, target=0.80)
    prefill = build_batch([ScheduledChunk([1] * 512, 1024, list(range(2048 // bs)), True)], bs)
    q = random_device(ops, (512, Hq, D))
    seconds = timed(lambda: ops.paged_attention(q, k_cache, v_cache, prefill, D ** -0.5), repeat=5)
    flops = 4 * 512 * (1024 + 256) * D * Hq
    ROWS.append(("speed paged_attention prefill 512 @1k", f"{seconds * 1e6:.0f} us", f"{flops / seconds / 1e12:.1f} TFLOP/s"))
    logits = cupy.random.standard_normal((64, 128256), dtype=cupy.float32)
    ROWS.append(("speed greedy 64x128256", f"{timed(lambda: ops.greedy(logits)) * 1e6:.0f} us", "includes the id copy"))


@section("decode step (Llama-3-8B shapes, bf16, batch 1)")
def time_decode_step():
    ops = cuda_ops.gpu("bfloat16")
    H, L, Hq, Hk, D, I, V = 4096, 32, 32, 8, 128, 14336, 128256
    layers = [dict(ln1=random_device(ops, (H,)), qkv=random_device(ops, ((Hq + 2 * Hk) * D, H), H ** -0.5),
                   o=random_device(ops, (H, Hq * D), H ** -0.5), ln2=random_device(ops, (H,)),
                   gate_up=random_device(ops, (2 * I, H), H ** -0.5), down=random_device(ops, (H, I), I ** -0.5))
              for _ in range(L)]
    embed, lm_head, norm = random_device(ops, (V, H)), random_device(ops, (V, H), H ** -0.5), random_device(ops, (H,))
    bs, ctx = 16, 512
    cache = [(ops.zeros((ctx // bs, Hk, bs, D)), ops.zeros((ctx // bs, Hk, bs, D))) for _ in range(L)]
    batch = build_batch([ScheduledChunk([5], ctx - 1, list(range(ctx // bs)), True)], bs)
    inv_freq = (1.0 / 500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32)

    def step():   # the layer sequence of minisarathi/model/llama.py
        hidden = ops.embedding(embed, batch.input_ids)
        residual = hidden
        x = ops.rms_norm(hidden, layers[0]["ln1"], 1e-5)
        for i, (lw, (kc, vc)) in enumerate(zip(layers, cache)):
            if i:
                x, residual = ops.add_rms_norm(hidden, residual, lw["ln1"], 1e-5)
            qkv = ops.linear(x, lw["qkv"])
            q = qkv[:, :Hq * D].reshape(1, Hq, D)
            k = qkv[:, Hq * D:(Hq + Hk) * D].reshape(1, Hk, D)
            v = qkv[:, (Hq + Hk) * D:].reshape(1, Hk, D)
            ops.rope(q, k, batch.positions, inv_freq)
            ops.store_kv(k, v, kc, vc, batch.slot_mapping)
            attn = ops.paged_attention(q, kc, vc, batch, D ** -0.5)
            hidden = ops.linear(attn.reshape(1, Hq * D), lw["o"])
            x, residual = ops.add_rms_norm(hidden, residual, lw["ln2"], 1e-5)
            hidden = ops.linear(ops.silu_and_mul(ops.linear(x, lw["gate_up"])), lw["down"])
        x, _ = ops.add_rms_norm(hidden, residual, norm, 1e-5)
        return ops.linear(x, lm_head)

    weight_bytes = sum(a.nbytes for lw in layers for a in lw.values()) + lm_head.nbytes + norm.nbytes
    bandwidth_row("decode step 8B bs=1", timed(step, repeat=10), weight_bytes, target=0.85)


@section("pytest on the GPU")
def run_pytest(out: Path):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_cuda_backend.py::test_bundled_model_on_gpu",
                             "tests/test_nvrtc.py"],
                            capture_output=True, text=True, timeout=240, cwd=Path(__file__).resolve().parent.parent)
    (out / "pytest.txt").write_text(result.stdout + result.stderr)
    summary = (result.stdout.strip().splitlines() or ["no output"])[-1]
    ROWS.append(("pytest cuda backend + nvrtc", "ok" if result.returncode == 0 else "FAILED", summary[:90]))


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
    return {"float": "IfE", "__half": "I6__halfE", "__nv_bfloat16": "I13__nv_bfloat16E"}[cxx]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    parser.add_argument("--ptxas-report", action="store_true", help="print the nvcc resource table and exit")
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    if args.ptxas_report:
        print(ptxas_report(args.arch))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        import cupy
        log(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, CuPy {cupy.__version__}")
    except Exception as exc:
        log(f"no usable GPU: {exc}")
        sys.exit(1)
    check_kernels()
    check_models()
    measure_ceilings()
    time_kernels()
    time_decode_step()
    run_pytest(args.out)
    (args.out / "details.txt").write_text("\n".join(DETAILS) + "\n")
    (args.out / "results.json").write_text(json.dumps({"rows": ROWS, "ceilings": CEILINGS}, indent=1))
    width = max(len(r[0]) for r in ROWS)
    print("\n" + "\n".join(f"{name:{width}s}  {result:>14s}  {detail}" for name, result, detail in ROWS))


if __name__ == "__main__":
    main()
