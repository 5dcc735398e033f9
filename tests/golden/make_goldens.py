"""Builds the tiny random-weight Hugging Face models under tests/golden/<name>/ and their reference outputs.

Needs torch and transformers, which minisarathi itself never imports:
    pip install torch==2.13.0 transformers
    python tests/golden/make_goldens.py [NAME ...]   # no NAME: every variant

Each folder gets config.json, generation_config.json, safetensors weights in the variant's dtype, and
golden.npz with the prompt, transformers' float32 logits for every prompt position (16-bit weights
upcast on load), greedy continuation tokens (a plain argmax loop over full forwards), and the versions.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

HERE = Path(__file__).resolve().parent
PROMPT_LEN = 24
NEW_TOKENS = 16
COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

VARIANTS = {
    # name: (config, saved dtype, max shard size or None)
    "llama_gqa_bf16": (
        LlamaConfig(
            **COMMON, vocab_size=256, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
        ),
        torch.bfloat16,
        "150KB",
    ),
    "qwen2_tied": (
        Qwen2Config(
            **COMMON,
            vocab_size=128,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
        torch.float32,
        None,
    ),
    "llama3_rope_fp16": (
        LlamaConfig(
            **COMMON,
            vocab_size=256,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        torch.float16,
        None,
    ),
    "mistral_mha": (
        MistralConfig(
            **COMMON,
            vocab_size=256,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=None,
        ),
        torch.float16,
        None,
    ),
    "llama_linear_rope_bias": (
        LlamaConfig(
            **COMMON,
            vocab_size=256,
            intermediate_size=128,
            num_attention_heads=8,
            num_key_value_heads=2,
            attention_bias=True,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
        torch.float16,
        None,
    ),
    # Qwen3: q/k norms, a head_dim other than hidden / heads; YaRN whose original context (16) the prompt
    # passes, so that both ends of its frequency ramp are exercised; dynamic NTK (untied, bf16)
    "qwen3_yarn_tied": (
        Qwen3Config(
            **COMMON,
            vocab_size=128,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        torch.float32,
        None,
    ),
    "qwen3_bf16": (
        Qwen3Config(
            **COMMON,
            vocab_size=256,
            intermediate_size=128,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        ),
        torch.bfloat16,
        None,
    ),
    # Mistral with a sliding window of 6 over every layer: the 24-token prompt is 4 windows long
    "mistral_sliding": (
        MistralConfig(
            **COMMON,
            vocab_size=256,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=6,
        ),
        torch.float32,
        None,
    ),
    # Gemma 3: local layers (window 6 under the 24-token prompt, their own RoPE base) around a global one
    # with linear RoPE scaling, q/k norms, a query_pre_attn_scalar other than head_dim, soft-capped logits
    "gemma3_sliding": (
        Gemma3TextConfig(
            **COMMON | {"num_hidden_layers": 3},
            vocab_size=256,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=8.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            },
        ),
        torch.float32,
        None,
    ),
    # Phi-3 (fused qkv_proj, gate_up_proj): LongRoPE with a short context of 16 under the 24-token prompt
    # (transformers takes long_factor for every position then), partial rotary 0.75 (12 of 16 head dims)
    "phi3_longrope_partial": (
        Phi3Config(
            **COMMON,
            vocab_size=256,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 16,
                "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            },
        ),
        torch.float32,
        None,
    ),
}


def randomize(model: torch.nn.Module) -> None:
    """Weights large enough that logits are peaked (greedy has clear winners); norms near 1, not exactly 1."""
    gemma = "gemma3" in type(model).__name__.lower()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "model.norm.weight" and gemma:  # (1 + w) about 5: the small tied table's logits
                param.copy_(4 + 0.2 * torch.randn_like(param))
            elif "norm" in name:  # Gemma 3 scales by (1 + w): about 1.5
                param.copy_((0.5 if gemma else 1) + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
            else:
                param.normal_(0, 2.0 / param.shape[-1] ** 0.5 if param.ndim == 2 else 1.0)
        # Gemma 3 scales its (tied) embedding by sqrt(hidden): smaller, so the current token does not drown
        # out the layers (greedy would repeat it)
        model.get_input_embeddings().weight.normal_(0, 0.05 if gemma else 1.0)


def make(name: str, config, dtype: torch.dtype, shard_size: str | None, seed: int) -> None:
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    model.to(dtype).save_pretrained(out, max_shard_size=shard_size or "10MB")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = torch.randint(3, config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = reloaded(prompt[None]).logits[0].numpy()  # float32[P, V]
        ids = prompt.tolist()
        for _ in range(NEW_TOKENS):
            ids.append(int(reloaded(torch.tensor([ids])).logits[0, -1].argmax()))
    top2 = np.sort(logits, axis=-1)[:, -2:]
    print(
        f"{name}: files {sorted(p.name for p in out.iterdir())}, "
        f"min top-2 logit gap {float((top2[:, 1] - top2[:, 0]).min()):.4f}"
    )
    np.savez_compressed(
        out / "golden.npz",
        prompt=prompt.numpy().astype(np.int32),
        logits=logits,
        greedy_tokens=np.array(ids[PROMPT_LEN:], dtype=np.int32),
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
    )


if __name__ == "__main__":
    for seed, (name, (config, dtype, shard_size)) in enumerate(VARIANTS.items()):
        if name in sys.argv[1:] or len(sys.argv) == 1:
            make(name, config, dtype, shard_size, seed)
