"""Which slice of each weight a rank holds (Megatron-LM's split of a transformer layer).

Column-parallel (each rank computes a slice of the outputs): qkv_proj by heads (rank r gets query heads
r*Hq/N .. and KV heads r*Hk/N .., so its KV cache holds only its own KV heads), gate_up_proj by
intermediate rows. Row-parallel (each rank reduces over a slice of the inputs, then the ranks' partial sums
are all-reduced): o_proj and down_proj by the matching input columns. o_proj's bias is added once, on rank 0.
Embedding, norms and lm_head are replicated: at these vocabulary sizes a vocab split would add a gather per
step for little memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from minisarathi.config import ModelConfig
from minisarathi.model.loader import CheckpointTensor
from minisarathi.quant.layouts import take_columns, take_rows
from minisarathi.validation import check_int


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError naming the rule when the model cannot be split over `size` ranks."""
    check_int("tensor_parallel_size", size, lo=1)
    for name in ("num_key_value_heads", "num_attention_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % size:
            raise ValueError(f"tensor_parallel_size ({size}) must divide the model's {name} ({value})")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's model runs: its share of the heads and of the MLP's intermediate size."""
    check_tensor_parallel(config, size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=config.num_key_value_heads // size,
        intermediate_size=config.intermediate_size // size,
    )


def shard_weights(
    weights: Mapping[str, CheckpointTensor], config: ModelConfig, rank: int, size: int
) -> dict[str, CheckpointTensor]:
    """Rank `rank`'s weights under LlamaModel's names (see loader.CheckpointWeights), sliced from the full
    ones."""
    check_tensor_parallel(config, size)
    D, I = config.head_dim, config.intermediate_size
    q_size, kv_size = config.num_attention_heads * D, config.num_key_value_heads * D
    q_rows, kv_rows, i_rows = _part(q_size, rank, size), _part(kv_size, rank, size), _part(I, rank, size)
    # rows of the fused [q; k; v] and [gate; up] tensors this rank keeps
    qkv = np.concatenate([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
    gate_up = np.concatenate([i_rows, I + i_rows])
    sharded = {}
    for name in weights:
        tensor = weights[name]
        kind = name.rsplit(".", 1)[-1]
        try:
            data = _shard(tensor, kind, rank, qkv, gate_up, q_rows, i_rows)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        sharded[name] = CheckpointTensor(tensor.dtype, data)
    return sharded


def _shard(tensor: CheckpointTensor, kind: str, rank: int, qkv, gate_up, q_rows, i_rows):
    """One tensor's share: an array, or a quantized layout sliced on whole groups (layouts.take_rows and
    take_columns), so a rank keeps the file's compact form."""
    data, quantized = tensor.data, tensor.dtype == "quantized"
    rows = qkv if kind in ("qkv_proj", "qkv_bias") else gate_up if kind == "gate_up_proj" else None
    if rows is not None:
        return take_rows(data, rows) if quantized else np.ascontiguousarray(data[rows])
    columns = q_rows if kind == "o_proj" else i_rows if kind == "down_proj" else None
    if columns is not None:
        start, stop = int(columns[0]), int(columns[-1]) + 1
        return take_columns(data, start, stop) if quantized else np.ascontiguousarray(data[:, start:stop])
    if kind == "o_bias" and rank > 0:
        return np.zeros_like(data)  # the row-parallel sum adds rank 0's copy once
    return data


def _part(n: int, rank: int, size: int) -> np.ndarray:
    """int64[n/size]: rank's contiguous share of range(n)."""
    share = n // size
    return np.arange(rank * share, (rank + 1) * share)
