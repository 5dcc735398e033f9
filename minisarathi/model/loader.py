"""Hugging Face safetensors checkpoints (one file or index-sharded; F32/F16/BF16) to fused float32 arrays.

The safetensors format is an 8-byte little-endian header length, a JSON header mapping each tensor name
to its dtype, shape and byte range, then the raw data. Reading it with np.memmap ourselves (rather than
safetensors' numpy loader, which has no bfloat16) only pages in the tensors that are used.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from minisarathi.config import ModelConfig

# bfloat16 has no NumPy dtype: its bits are read as uint16 and widened by bf16_to_float32.
STORED_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


def load_weights(model_dir: str | Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """The model's float32 weights under the names LlamaModel uses, q/k/v and gate/up fused.

    Keys: embed_tokens, norm, lm_head (untied only), and per layer i `layers.{i}.` + input_layernorm,
    qkv_proj, qkv_bias (if config.qkv_bias), o_proj, o_bias (if config.o_bias), post_attention_layernorm,
    gate_up_proj, down_proj. Weights keep HF's [out, in] layout.
    """
    stored = read_checkpoint(model_dir)
    c = config
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in stored:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {str(model_dir)!r}")
        dtype, raw = stored[name]
        if raw.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {list(raw.shape)}, expected {list(shape)}")
        return to_float32(dtype, raw)

    H, I = c.hidden_size, c.intermediate_size
    weights = {"embed_tokens": get("model.embed_tokens.weight", (c.vocab_size, H)),
               "norm": get("model.norm.weight", (H,))}
    if not c.tie_word_embeddings:
        weights["lm_head"] = get("lm_head.weight", (c.vocab_size, H))
    for i in range(c.num_hidden_layers):
        attn, mlp, out = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"layers.{i}."
        weights[out + "input_layernorm"] = get(f"model.layers.{i}.input_layernorm.weight", (H,))
        weights[out + "qkv_proj"] = np.concatenate([get(attn + "q_proj.weight", (q_size, H)),
                                                    get(attn + "k_proj.weight", (kv_size, H)),
                                                    get(attn + "v_proj.weight", (kv_size, H))])
        if c.qkv_bias:
            weights[out + "qkv_bias"] = np.concatenate([get(attn + "q_proj.bias", (q_size,)),
                                                        get(attn + "k_proj.bias", (kv_size,)),
                                                        get(attn + "v_proj.bias", (kv_size,))])
        weights[out + "o_proj"] = get(attn + "o_proj.weight", (H, q_size))
        if c.o_bias:
            weights[out + "o_bias"] = get(attn + "o_proj.bias", (H,))
        weights[out + "post_attention_layernorm"] = get(f"model.layers.{i}.post_attention_layernorm.weight", (H,))
        weights[out + "gate_up_proj"] = np.concatenate([get(mlp + "gate_proj.weight", (I, H)),
                                                        get(mlp + "up_proj.weight", (I, H))])
        weights[out + "down_proj"] = get(mlp + "down_proj.weight", (H, I))
    return weights


def read_checkpoint(model_dir: str | Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (safetensors dtype, memory-mapped array) over model.safetensors or its index's shards."""
    model_dir = Path(model_dir)
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_file} has no weight_map")
        files = sorted(set(weight_map.values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"model_dir {str(model_dir)!r} has neither model.safetensors nor "
                         "model.safetensors.index.json")
    tensors = {}
    for file in files:
        tensors.update(read_safetensors(model_dir / file))
    return tensors


def read_safetensors(file: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype, array) of one .safetensors file; the arrays are read-only views of a memmap."""
    if not file.is_file():
        raise ValueError(f"checkpoint file {str(file)!r} does not exist")
    data = np.memmap(file, dtype=np.uint8, mode="r").view(np.ndarray)  # plain arrays that share the mapping
    header_len = int(data[:8].view("<u8")[0]) if len(data) >= 8 else -1
    if not 0 < header_len <= len(data) - 8:
        raise ValueError(f"{file} is not a safetensors file (bad header length {header_len})")
    header = json.loads(bytes(data[8:8 + header_len]))
    body = data[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if dtype not in STORED_DTYPES:
            raise ValueError(f"tensor {name!r} in {file} has dtype {dtype}; supported: {', '.join(STORED_DTYPES)}")
        if end - begin != STORED_DTYPES[dtype].itemsize * int(np.prod(shape)) or end > len(body):
            raise ValueError(f"tensor {name!r} in {file} has data_offsets {[begin, end]} that do not fit "
                             f"its shape {list(shape)}")
        tensors[name] = (dtype, body[begin:end].view(STORED_DTYPES[dtype]).reshape(shape))
    return tensors


def to_float32(dtype: str, raw: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 copy of a stored tensor (exact: every F16/BF16 value is a float32 value)."""
    if dtype == "BF16":
        return bf16_to_float32(raw)
    return np.ascontiguousarray(raw, dtype=np.float32)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32: shift its 16 bits up and reinterpret."""
    return (bits.astype(np.uint32) << 16).view(np.float32)
