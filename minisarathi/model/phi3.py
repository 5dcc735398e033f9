"""Phi-3 / Phi-4-mini (Phi3ForCausalLM): the Llama forward pass over a checkpoint whose q/k/v and gate/up
projections are stored fused, with partial rotary where partial_rotary_factor < 1 (its LongRoPE tables are
config.py's rope_inv_freq).

Partial rotary: transformers turns dims [0, R) of each head with rotate_half over R (pairs i, i + R/2) and
passes [R, D) through; the backends pair i with i + D/2. Permuting the q and k rows of each head to
[rot[:R/2], pass[:P/2], rot[R/2:], pass[P/2:]] (P = D - R) makes the two the same, with zero frequencies
(cos 1, sin 0) on the passed dims; q.k is unchanged since q and k are permuted alike. V is not permuted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from minisarathi.config import ModelConfig, language_model


def checkpoint_tensors(tensors: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """A checkpoint's tensors under the Llama names the loader reads: a multimodal model's language model,
    Phi-3's fused qkv_proj and gate_up_proj as row views q_proj/k_proj/v_proj and gate_proj/up_proj, a base
    model's (Qwen3-Embedding's checkpoints are Qwen3Model's, named without "model.") under "model."."""
    if "model.embed_tokens.weight" not in tensors and "embed_tokens.weight" in tensors:
        tensors = {f"model.{name}": tensor for name, tensor in tensors.items()}
    if config.multimodal:
        return language_model(tensors)
    if config.architecture != "Phi3ForCausalLM":
        return tensors
    c, split = config, dict(tensors)
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    fused = {("self_attn", "qkv_proj"): (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size))}
    fused["mlp", "gate_up_proj"] = (("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size))
    for i in range(c.num_hidden_layers):
        for (module, name), pieces in fused.items():
            prefix = f"model.layers.{i}.{module}."
            key, rows = f"{prefix}{name}.weight", sum(n for _, n in pieces)
            tensor = split.pop(key, None)
            if tensor is None:
                raise ValueError(f"tensor {key!r} is missing from the checkpoint")
            if tensor.dtype == "quantized":
                raise ValueError(f"tensor {key!r}: quantized Phi3ForCausalLM checkpoints are not supported")
            if tensor.shape != (rows, c.hidden_size):
                raise ValueError(
                    f"tensor {key!r} has shape {list(tensor.shape)}, expected {[rows, c.hidden_size]}"
                )
            start = 0
            for piece, n in pieces:  # a view of the stored rows, no copy
                split[f"{prefix}{piece}.weight"] = dataclasses.replace(
                    tensor, data=tensor.data[start : start + n]
                )
                start += n
    return split


def rotary_order(weights: Mapping[str, Any], config: ModelConfig) -> Mapping[str, Any]:
    """The loader's weights, with q and k rows in the backends' rotary order where only part of each head
    turns (see the module docstring)."""
    R = config.rotary_dim
    if R is None or R == config.head_dim:
        return weights
    return _RotaryOrder(weights, config)


class _RotaryOrder(Mapping):
    def __init__(self, weights: Mapping[str, Any], config: ModelConfig):
        self._weights = weights
        D, R = config.head_dim, config.rotary_dim
        P = D - R  # R and P are even (config.py checks)
        head = np.concatenate(
            [
                np.arange(R // 2),
                R + np.arange(P // 2),
                R // 2 + np.arange(R // 2),
                R + P // 2 + np.arange(P // 2),
            ]
        )  # int[D]: the stored row of each permuted one
        heads = config.num_attention_heads + config.num_key_value_heads
        v_rows = np.arange(heads * D, (heads + config.num_key_value_heads) * D)
        self._rows = np.concatenate([(np.arange(heads)[:, None] * D + head).ravel(), v_rows])

    def __getitem__(self, name: str) -> Any:
        tensor = self._weights[name]
        if not name.endswith(".qkv_proj"):
            return tensor
        return dataclasses.replace(
            tensor, data=np.asarray(tensor.data)[self._rows]
        )  # a host copy, stored dtype

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)
