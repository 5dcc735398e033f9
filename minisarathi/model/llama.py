"""The Llama-family forward pass (Llama 2/3, Mistral, Qwen2), written once against a backend's ops.

One call runs a flat batch of tokens from many sequences (docs/architecture.md, the batch contract):
prefill chunks and decodes alike, writing their K/V into the paged cache and returning logits only for
the rows that are sampled.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from minisarathi.backends.base import Backend
from minisarathi.batch import Batch
from minisarathi.config import ModelConfig
from minisarathi.model.decode_graphs import DecodeGraphs
from minisarathi.parallel.communicator import Communicator
from minisarathi.quant.layouts import weight_format
from minisarathi.validation import check_int


@dataclass
class LayerWeights:
    input_layernorm: Any  # [H]
    qkv_proj: Any  # [(Hq + 2 Hk) D, H]
    qkv_bias: Any | None  # [(Hq + 2 Hk) D]
    q_norm: Any | None  # [D], Qwen3
    k_norm: Any | None  # [D], Qwen3
    o_proj: Any  # [H, Hq D]
    o_bias: Any | None  # [H]
    post_attention_layernorm: Any  # [H]
    gate_up_proj: Any  # [2 I, H]
    down_proj: Any  # [H, I]


# of LayerWeights: read by linear only
LINEAR_WEIGHTS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})


class LlamaModel:
    def __init__(
        self, config: ModelConfig, weights: Mapping[str, Any], ops: Backend, comm: Communicator | None = None
    ):
        """weights as load_weights returns them (checkpoint tensors, which ops.weight places in the backend's
        dtype) or float32 arrays; ops the backend that places them and runs the forward pass.
        comm: one rank of a tensor-parallel group, which runs `config` and `weights` as sharded by
        minisarathi/parallel/sharding.py and sums o_proj's and down_proj's partial outputs over the ranks."""
        if (
            type(self) is LlamaModel and config.architecture == "Gemma3ForCausalLM"
        ):  # the tensor-parallel ranks'
            raise ValueError("Gemma 3 runs without tensor parallelism: its forward is model/gemma.py's")
        self.config = config
        self.ops = ops
        self.comm = comm
        self.embed_tokens = ops.weight(weights["embed_tokens"])
        self.norm = ops.weight(weights["norm"])
        # tied: the embedding table in linear's form (CpuOps packs a copy of it; CudaOps shares it)
        self.lm_head = ops.linear_weight(
            self.embed_tokens if config.tie_word_embeddings else ops.weight(weights["lm_head"])
        )
        fields = LayerWeights.__dataclass_fields__
        self.layers = [
            LayerWeights(**{name: self._place(name, weights.get(f"layers.{i}.{name}")) for name in fields})
            for i in range(config.num_hidden_layers)
        ]
        # float32 on every backend (16-bit angles would ruin far positions), built once from float64 angles.
        self.rope_cos_sin = ops.constant(config.rope_cos_sin())  # float32[max_position_embeddings, D]
        self.scale = config.head_dim**-0.5
        self.decode_graphs: DecodeGraphs | None = None  # use_decode_buckets() sets it
        self.weight_format = weight_format(weights)  # "bfloat16", "Q4_K+Q6_K", ...
        # what the placed weights take in the backend's memory (a tied lm_head's packed copy included)
        layer_weights = [w for layer in self.layers for w in vars(layer).values() if w is not None]
        placed = {id(w): w for w in [self.embed_tokens, self.norm, self.lm_head, *layer_weights]}
        self.weight_bytes = sum(w.nbytes for w in placed.values())

    def _place(self, name: str, array: Any | None) -> Any:
        if array is None:
            return None  # a bias the model has not
        placed = self.ops.weight(array)
        return self.ops.linear_weight(placed) if name in LINEAR_WEIGHTS else placed

    def new_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[Any, Any]]:
        """Per layer (k_cache, v_cache), each [num_blocks, Hk, block_size, D] in the activation dtype."""
        check_int("num_blocks", num_blocks, lo=1)
        check_int("block_size", block_size, lo=1)
        shape = (num_blocks, self.config.num_key_value_heads, block_size, self.config.head_dim)
        return [(self.ops.zeros(shape), self.ops.zeros(shape)) for _ in range(self.config.num_hidden_layers)]

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim  # K and V elements
        return per_token * block_size * self.ops.activation_dtype.itemsize

    def copy_blocks(
        self, kv_cache: list[tuple[Any, Any]], sources: list[int], destinations: list[int]
    ) -> None:
        """KV block sources[i] onto destinations[i] in every layer (the backend's copy_blocks)."""
        self.ops.copy_blocks(kv_cache, sources, destinations)

    def free_memory_bytes(self) -> int | None:
        """Device memory free now (None: host memory), which sizes the KV cache."""
        return self.ops.free_memory_bytes()

    def rank_info(self) -> list[dict]:
        """The processes that run the model (tensor parallelism has one per rank)."""
        info = {"rank": 0, "pid": os.getpid(), "host": socket.gethostname(), "device": self.ops.device}
        return [info | {"weight_bytes": self.weight_bytes}]

    def new_sampler(self, seed: int = 0, eos_token_ids: tuple[int, ...] = ()):
        """The backend's sampler for forward(..., device_logits=True)'s logits."""
        return self.ops.new_sampler(self.config.vocab_size, seed, eos_token_ids)

    def use_decode_buckets(
        self, max_num_seqs: int, max_model_len: int, block_size: int, kv_cache: list | None = None
    ) -> list[int]:
        """From now on, forward() pads decode-only batches to batch-size buckets and, given the KV cache (CUDA
        backends), replays each bucket's CUDA graph, all captured now (minisarathi/model/decode_graphs.py).
        Returns the buckets."""
        self.decode_graphs = DecodeGraphs(self, max_num_seqs, max_model_len, block_size, kv_cache)
        return self.decode_graphs.sizes

    def forward(self, batch: Batch, kv_cache: list[tuple[Any, Any]], device_logits: bool = False) -> Any:
        """float32[N, vocab] NumPy logits of the rows batch.logits_indices, after writing the batch's K/V.
        device_logits: leave them where the backend computed them, in its dtype, for new_sampler()'s
        sampler."""
        if self.decode_graphs is not None and self.decode_graphs.takes(batch):
            logits = self.decode_graphs.forward(batch, kv_cache)
        else:
            # one host-to-device copy of the step's metadata, read by every layer
            self.ops.upload_batch(batch)
            logits = self.run(batch, kv_cache)
        return logits if device_logits else self.ops.to_numpy(logits)

    def run(self, batch: Batch, kv_cache: list[tuple[Any, Any]]) -> Any:
        """The launches of a forward pass over a batch already uploaded (ops.upload_batch): no host-to-device
        copy and, for a graph bucket's batch, no decision that depends on the step's values, so that a CUDA
        graph can capture it. Logits [N, vocab] on the device, in the backend's dtype."""
        ops, c = self.ops, self.config
        T, D = batch.num_tokens, c.head_dim
        q_size, kv_size = c.num_attention_heads * D, c.num_key_value_heads * D
        hidden = ops.embedding(self.embed_tokens, batch.input_ids)  # [T, H]
        residual = None
        for layer, (k_cache, v_cache), window in zip(self.layers, kv_cache, c.layer_windows):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_layernorm, c.rms_norm_eps)
            else:
                x, residual = ops.add_rms_norm(hidden, residual, layer.input_layernorm, c.rms_norm_eps)
            qkv = ops.linear(x, layer.qkv_proj, layer.qkv_bias)  # [T, (Hq + 2 Hk) D]
            q = qkv[:, :q_size].reshape(T, c.num_attention_heads, D)
            k = qkv[:, q_size : q_size + kv_size].reshape(T, c.num_key_value_heads, D)
            v = qkv[:, q_size + kv_size :].reshape(T, c.num_key_value_heads, D)
            if layer.q_norm is not None:  # the backends' RMSNorm over each head's D, [T, heads, D] out
                q = ops.rms_norm(q, layer.q_norm, c.rms_norm_eps)
                k = ops.rms_norm(k, layer.k_norm, c.rms_norm_eps)
            ops.rope_store_kv(
                q, k, v, k_cache, v_cache, batch.positions, batch.slot_mapping, self.rope_cos_sin
            )
            attn = ops.paged_attention(q, k_cache, v_cache, batch, self.scale, window)  # [T, Hq, D]
            hidden = ops.linear(attn.reshape(T, q_size), layer.o_proj, layer.o_bias)  # [T, H]
            if self.comm is not None:
                hidden = self.comm.all_reduce(hidden)
            x, residual = ops.add_rms_norm(hidden, residual, layer.post_attention_layernorm, c.rms_norm_eps)
            hidden = ops.linear(ops.silu_and_mul(ops.linear(x, layer.gate_up_proj)), layer.down_proj)
            if self.comm is not None:
                hidden = self.comm.all_reduce(hidden)
        # Only the sampled rows go through the final norm and the (large) vocabulary projection; when every
        # row is sampled (decodes) no gather is needed (a graph could not capture a host-side one on the
        # emulator).
        rows = batch.logits_indices
        if len(rows) < T:
            hidden, residual = hidden[rows], residual[rows]
        x, _ = ops.add_rms_norm(hidden, residual, self.norm, c.rms_norm_eps)
        self.final_hidden = x  # [N, H]: what embedding requests pool (model/pooling.py)
        return ops.linear(x, self.lm_head)  # [N, vocab]
