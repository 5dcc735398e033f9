"""A seeded random-weight Llama in Hugging Face format, of any shape, for timing studies.

The bundled model's tokenizer files (512 tokens), so it loads and serves like any HF folder; the model's own
vocabulary may be larger (as checkpoints pad theirs), with ids past the tokenizer's decoding to nothing.
Weights are float32 N(0, 0.02) (HF's initializer_range), norms 1, untied lm_head: the output is
nonsense but every matmul and attention costs exactly what a trained model of the shape would.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from minisarathi.paths import default_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
VOCAB_SIZE = 512


def write_random_model(
    path,
    hidden_size: int = 512,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    intermediate_size: int = 1408,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
) -> Path:
    for name, value in (
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("intermediate_size", intermediate_size),
        ("max_position_embeddings", max_position_embeddings),
        ("vocab_size", vocab_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must divide hidden_size ({hidden_size}) and be a "
            f"multiple of num_kv_heads ({num_kv_heads})"
        )
    head_dim = hidden_size // num_heads
    if head_dim % 2:
        raise ValueError(f"hidden_size / num_heads must be even for RoPE, got {head_dim}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    if vocab_size < VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least the tokenizer's {VOCAB_SIZE}, got {vocab_size}")
    tensors = {
        "model.embed_tokens.weight": normal(vocab_size, hidden_size),
        "model.norm.weight": np.ones(hidden_size, np.float32),
        "lm_head.weight": normal(vocab_size, hidden_size),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(hidden_size, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden_size, np.float32),
            p + "self_attn.q_proj.weight": normal(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": normal(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.v_proj.weight": normal(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.o_proj.weight": normal(hidden_size, num_heads * head_dim),
            p + "mlp.gate_proj.weight": normal(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": normal(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": normal(hidden_size, intermediate_size),
        }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": vocab_size,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(default_model_dir() / name, path / name)
    return path
