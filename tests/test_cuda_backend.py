"""Whole models through the CUDA backend's kernels: on the CPU emulator always, on a real GPU when present."""
from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends import cuda_ops, numpy_ops
from minisarathi.config import ModelConfig
from minisarathi.engine.batch import ScheduledChunk, build_batch
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import load_weights
from minisarathi.paths import default_model_dir

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_MODELS = ["llama_gqa_bf16", "qwen2_tied", "llama3_rope_fp16", "mistral_mha", "llama_linear_rope_bias"]


def build_model(path: Path, ops) -> LlamaModel:
    config = ModelConfig.from_pretrained(path)
    model = LlamaModel(config, load_weights(path, config), ops)
    # RoPE frequencies stay float32 whatever the activation dtype (a 16-bit inv_freq ruins long positions).
    model.inv_freq = config.rope_inv_freq()
    return model


def run_mixed_steps(model, prompts: list[list[int]], new_tokens: int, chunk_size: int, block_size: int = 4):
    """Greedy generation for several sequences with chunked prefills and decodes sharing batches, as the
    Sarathi scheduler would mix them. Returns (token lists, every step's logits)."""
    tables, next_block = [], 0
    for p in prompts:
        need = -(-(len(p) + new_tokens) // block_size)
        tables.append(list(range(next_block + need - 1, next_block - 1, -1)))   # blocks in reverse order
        next_block += need
    cache = model.new_kv_cache(next_block, block_size)
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)        # tokens of each sequence already in the cache
    target = [len(p) + new_tokens for p in prompts]
    all_logits = []
    while any(len(t) < n for t, n in zip(tokens, target)):
        chunks, owners = [], []
        budget = chunk_size
        for s, t in enumerate(tokens):
            if len(t) >= target[s] or budget == 0:
                continue
            take = min(budget, len(t) - done[s])
            chunks.append(ScheduledChunk(t[done[s]:done[s] + take], done[s], tables[s], done[s] + take == len(t)))
            owners.append(s)
            done[s] += take
            budget -= take
        logits = model.forward(build_batch(chunks, block_size), cache)
        all_logits.append(logits)
        sampled = [s for s, c in zip(owners, chunks) if c.sample]
        for s, row in zip(sampled, logits):
            tokens[s].append(int(row.argmax()))
    return tokens, np.concatenate(all_logits)


emulator_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only")
PROMPTS = [[1, 403, 407, 261, 378, 10, 65, 2], [1, 9], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310]]


@emulator_only
def test_bundled_model_on_emulated_kernels_matches_numpy():
    reference, ref_logits = run_mixed_steps(build_model(default_model_dir(), numpy_ops), PROMPTS, 12, chunk_size=7)
    tokens, logits = run_mixed_steps(build_model(default_model_dir(), cuda_ops.emulated()), PROMPTS, 12, chunk_size=7)
    assert tokens == reference
    np.testing.assert_allclose(logits, ref_logits, atol=2e-4 * np.abs(ref_logits).max())


@emulator_only
def test_bundled_model_in_bfloat16_stays_close():
    _, ref_logits = run_mixed_steps(build_model(default_model_dir(), numpy_ops), PROMPTS[:2], 3, chunk_size=16)
    _, logits = run_mixed_steps(build_model(default_model_dir(), cuda_ops.emulated("bfloat16")), PROMPTS[:2], 3,
                                chunk_size=16)
    # bf16 keeps 8 bits of mantissa through 5 layers: logits agree to about 1.5% of their range (measured).
    assert np.abs(logits - ref_logits).max() <= 0.03 * np.abs(ref_logits).max()


@emulator_only
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_golden_models_on_emulated_kernels(name):
    """GQA, MHA, QKV bias, tied embeddings, linear and llama3 RoPE scaling against transformers' logits."""
    golden = np.load(GOLDEN / name / "golden.npz")
    prompt = golden["prompt"].tolist()
    model = build_model(GOLDEN / name, cuda_ops.emulated())
    cache = model.new_kv_cache(-(-len(prompt) // 4), 4)
    batch = build_batch([ScheduledChunk(prompt, 0, list(range(len(cache[0][0]))), True)], 4)
    batch.logits_indices = np.arange(batch.num_tokens, dtype=np.int32)
    logits = model.forward(batch, cache)
    assert np.abs(logits - golden["logits"]).max() <= 1e-4 * np.abs(golden["logits"]).max()


@emulator_only
def test_engine_hybrid_batches_on_emulated_kernels(monkeypatch):
    """The whole engine (Sarathi chunked prefills mixed with decodes, 4-token KV blocks) on emulated kernels
    generates exactly what it generates on NumPy."""
    import minisarathi.engine.engine as engine_module
    from minisarathi.llm import LLM
    from minisarathi.sampling_params import SamplingParams
    prompts = ["Once upon a time", "Tom had a red", "Lily and Tom went to the park. They saw"]
    params = SamplingParams(max_tokens=10, temperature=0)
    def generate():
        llm = LLM(scheduler="sarathi", chunk_size=8, block_size=4, num_kv_blocks=64)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm.engine.model.ops
    expected, ops = generate()
    assert ops is numpy_ops
    monkeypatch.setattr(engine_module, "load_model",
                        lambda path, device="cpu": build_model(Path(path), cuda_ops.emulated()))
    tokens, ops = generate()
    assert isinstance(ops, cuda_ops.CudaOps)
    assert tokens == expected


def test_emulated_ops_reject_a_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        cuda_ops.emulated("int8")


def _gpu_available() -> str | None:
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
        return "no CUDA device"
    except Exception as exc:   # no CuPy, or no driver
        return f"no usable GPU ({type(exc).__name__})"


@pytest.mark.skipif(_gpu_available() is not None, reason=str(_gpu_available()))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bundled_model_on_gpu(dtype):
    reference, ref_logits = run_mixed_steps(build_model(default_model_dir(), numpy_ops), PROMPTS, 6, chunk_size=7)
    tokens, logits = run_mixed_steps(build_model(default_model_dir(), cuda_ops.gpu(dtype)), PROMPTS, 6, chunk_size=7)
    if dtype == "float32":
        assert tokens == reference
        np.testing.assert_allclose(logits, ref_logits, atol=2e-4 * np.abs(ref_logits).max())
    else:
        assert np.abs(logits[:3] - ref_logits[:3]).max() <= 0.06 * np.abs(ref_logits).max()
