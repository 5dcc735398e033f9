"""Gemma 3 text models (Gemma3ForCausalLM, or Gemma3ForConditionalGeneration's language model): the Llama
forward pass with Gemma's differences, beside llama.py.

As transformers' Gemma3 computes them: every RMSNorm scales by (1 + w) (folded into the weights here, in
float32; a GGUF file holds 1 + w already), q and k get per-head norms, the attention output and the MLP
output are normed before they join the residual (post_attention_layernorm, post_feedforward_layernorm) and
the MLP input has its own norm (pre_feedforward_layernorm); the MLP is GeGLU with tanh GELU; the embedding
is scaled by sqrt(hidden) in the weights' dtype (a scaled copy of the table: the tied lm_head reads the
unscaled one); the attention scale is query_pre_attn_scalar**-0.5; sliding layers attend over their window
with RoPE base local_rope_theta, global ones over everything with rope_theta and rope_scaling; the logits
are soft-capped where the config says.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from minisarathi.backends.base import Backend
from minisarathi.batch import Batch
from minisarathi.config import GEMMA3_NORMS, ModelConfig
from minisarathi.dtypes import convert, to_float32
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import CheckpointTensor

NORMS = ("norm", "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", *GEMMA3_NORMS)


class OnePlusNorms(Mapping):
    """The loader's weights with every RMSNorm weight w given as 1 + w (float32)."""

    def __init__(self, weights: Mapping[str, Any]):
        self._weights = weights

    def __getitem__(self, name: str) -> Any:
        tensor = self._weights[name]
        if name.rsplit(".", 1)[-1] not in NORMS:
            return tensor
        return CheckpointTensor("float32", np.asarray(tensor, dtype=np.float32) + np.float32(1))

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def scaled_embedding(table: CheckpointTensor, hidden_size: int) -> CheckpointTensor:
    """table * sqrt(hidden), the factor and the product rounded to the table's dtype, as transformers'
    Gemma3TextScaledWordEmbedding multiplies each looked-up row. A quantized (GGUF) table is dequantized and
    scaled in float32, as llama.cpp scales the rows it gathers: a float32 copy of the table."""
    if table.dtype == "quantized":
        return CheckpointTensor("float32", np.asarray(table) * np.float32(hidden_size**0.5))
    scale = convert(np.float32(hidden_size**0.5)[None], "float32", table.dtype)  # the factor in that dtype
    product = to_float32(table.data, table.dtype) * to_float32(scale, table.dtype)  # exact in float32
    return CheckpointTensor(table.dtype, convert(product, "float32", table.dtype))


class Gemma3Model(LlamaModel):
    def __init__(self, config: ModelConfig, weights: Mapping[str, Any], ops: Backend):
        weights = weights if config.norms_include_one else OnePlusNorms(weights)
        super().__init__(config, weights, ops)
        self.embed_tokens = ops.weight(scaled_embedding(weights["embed_tokens"], config.hidden_size))
        # per layer: (pre_feedforward_layernorm, post_feedforward_layernorm), each [H]
        self.feedforward_norms = [
            tuple(ops.weight(weights[f"layers.{i}.{name}"]) for name in GEMMA3_NORMS)
            for i in range(config.num_hidden_layers)
        ]
        self.local_cos_sin = ops.constant(config.local_rope_cos_sin())  # the sliding layers' RoPE table
        self.scale = config.query_pre_attn_scalar**-0.5
        extra = [self.embed_tokens, *(w for norms in self.feedforward_norms for w in norms)]
        self.weight_bytes += sum(w.nbytes for w in extra)

    def run(self, batch: Batch, kv_cache: list[tuple[Any, Any]]) -> Any:
        """LlamaModel.run's contract (no host copy, no decision on the step's values), Gemma 3's layers."""
        ops, c, eps = self.ops, self.config, self.config.rms_norm_eps
        T, D = batch.num_tokens, c.head_dim
        q_size, kv_size = c.num_attention_heads * D, c.num_key_value_heads * D
        hidden = ops.embedding(self.embed_tokens, batch.input_ids)  # [T, H]
        residual = None
        layers = zip(self.layers, self.feedforward_norms, kv_cache, c.layer_windows)
        for layer, (pre_feedforward, post_feedforward), (k_cache, v_cache), window in layers:
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_layernorm, eps)
            else:
                x, residual = ops.add_rms_norm(hidden, residual, layer.input_layernorm, eps)
            qkv = ops.linear(x, layer.qkv_proj, layer.qkv_bias)  # [T, (Hq + 2 Hk) D]
            q = ops.rms_norm(qkv[:, :q_size].reshape(T, c.num_attention_heads, D), layer.q_norm, eps)
            k = ops.rms_norm(
                qkv[:, q_size : q_size + kv_size].reshape(T, c.num_key_value_heads, D), layer.k_norm, eps
            )
            v = qkv[:, q_size + kv_size :].reshape(T, c.num_key_value_heads, D)
            cos_sin = self.rope_cos_sin if window is None else self.local_cos_sin
            ops.rope_store_kv(q, k, v, k_cache, v_cache, batch.positions, batch.slot_mapping, cos_sin)
            attn = ops.paged_attention(q, k_cache, v_cache, batch, self.scale, window)  # [T, Hq, D]
            hidden = ops.linear(attn.reshape(T, q_size), layer.o_proj, layer.o_bias)  # [T, H]
            hidden = ops.rms_norm(hidden, layer.post_attention_layernorm, eps)
            x, residual = ops.add_rms_norm(hidden, residual, pre_feedforward, eps)
            hidden = ops.linear(ops.gelu_tanh_and_mul(ops.linear(x, layer.gate_up_proj)), layer.down_proj)
            hidden = ops.rms_norm(hidden, post_feedforward, eps)
        rows = batch.logits_indices
        if len(rows) < T:  # only the sampled rows (see LlamaModel.run)
            hidden, residual = hidden[rows], residual[rows]
        x, _ = ops.add_rms_norm(hidden, residual, self.norm, eps)
        self.final_hidden = x  # [N, H]: what embedding requests pool (model/pooling.py)
        logits = ops.linear(x, self.lm_head)  # [N, vocab]
        cap = c.final_logit_softcapping
        return logits if cap is None else ops.softcap(logits, cap)
