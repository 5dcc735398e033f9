"""Embedding requests (LLM.embed, OpenAI's /v1/embeddings, the msgpack door's `embed`): a prompt run as
prefill chunks in the same batches as generation, never sampled. Its last chunk's last row is a sampled row
for the model, so it goes through the final norm, whose output the model keeps (`final_hidden`, on every
backend); that row, L2-normalised, is the embedding: last-token pooling, Qwen3-Embedding's convention.

The engine reaches this module through three hooks: prefill_only (prepare_request), take_rows (after the
forward) and finish (the update, which frees the request's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minisarathi.outputs import RequestOutput
from minisarathi.sampling_params import SamplingParams
from minisarathi.validation import check_int

# What the engine's checks and block reservations see for an embedding request: its prompt's KV, no more.
PREFILL_ONLY = SamplingParams(max_tokens=1, detokenize=False)


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's name for an embedding request's settings. dimensions: the embedding keeps its first
    `dimensions` features, normalised after the cut (Matryoshka truncation, which Qwen3-Embedding is trained
    for); None: all hidden_size."""

    dimensions: int | None = None

    def __post_init__(self):
        if self.dimensions is not None:
            check_int("dimensions", self.dimensions, lo=1)


def prefill_only(engine, params) -> tuple[PoolingParams | None, object]:
    """(the request's PoolingParams or None, the params the engine's checks see): an embedding request's
    pooling settings, checked against the model, and PREFILL_ONLY in their place; other params unchanged."""
    if not isinstance(params, PoolingParams):
        return None, params
    if engine.config.tensor_parallel_size > 1:
        raise ValueError("embedding requests run without tensor parallelism (tensor_parallel_size 1)")
    hidden = engine.model_config.hidden_size
    if params.dimensions is not None and params.dimensions > hidden:
        raise ValueError(f"dimensions must be <= the model's hidden_size ({hidden}), got {params.dimensions}")
    return params, PREFILL_ONLY


def take_rows(model, logits, samplers: list, num_prefill: int):
    """Right after the forward: the embedding requests whose prompt ended in this step leave the sampling
    rows. Returns (logits, samplers) without them, and `pooled`: () or (their sequences, their final-norm
    rows [len, H] on the device, in the activation dtype) for finish()."""
    if not num_prefill:  # a decode-only step ends no prompt
        return logits, samplers, ()
    rows = [r for r, seq in enumerate(samplers) if seq.pooling is not None]
    if not rows:
        return logits, samplers, ()
    keep = [r for r, seq in enumerate(samplers) if seq.pooling is None]
    pooled = ([samplers[r] for r in rows], model.final_hidden[rows])
    return logits[keep], [samplers[r] for r in keep], pooled


def finish(engine, pooled, now: float) -> list[RequestOutput]:
    """The update of a step's embedding requests: each leaves its queue (it may have been preempted or
    paused while its step was in flight) with its blocks freed, finished, and gets its output. One aborted
    meanwhile is skipped: the abort reported it."""
    if not pooled:
        return []
    seqs, hidden = pooled
    rows = engine.model.ops.to_numpy(hidden).astype(np.float64)  # float64[len(seqs), H]
    outputs = []
    for seq, row in zip(seqs, rows):
        if seq.is_finished:
            continue
        engine.scheduler.abort(seq)  # out of whichever queue holds it; its blocks freed
        engine._finish(seq, "stop", None, now)
        outputs.append(
            RequestOutput(
                seq.request_id,
                seq.prompt,
                seq.prompt_token_ids,
                [],
                True,
                seq.metrics,
                seq.num_cached_tokens,
                embedding=normalize(row[: seq.pooling.dimensions]),
            )
        )
    return outputs


def normalize(row: np.ndarray) -> np.ndarray:
    """float32[d]: row / its L2 norm, with torch.nn.functional.normalize's floor (1e-12) under the norm."""
    return (row / max(float(np.linalg.norm(row)), 1e-12)).astype(np.float32)
