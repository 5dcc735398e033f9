"""Batches built by hand and the checks on them, for tests and benchmark scripts that drive the model without
the engine."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minisarathi.batch import Batch, make_batch


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: `token_ids` at positions start_pos.. over its block table."""

    token_ids: list[int]
    start_pos: int  # tokens of this sequence already in the cache
    block_table: list[int]  # must cover start_pos + len(token_ids) tokens
    sample: bool  # whether this chunk ends where a token is sampled


def build_batch(chunks: list[ScheduledChunk], block_size: int) -> Batch:
    width = max((len(c.block_table) for c in chunks), default=0)
    block_tables = np.zeros((len(chunks), max(width, 1)), dtype=np.int32)
    for s, c in enumerate(chunks):
        block_tables[s, : len(c.block_table)] = c.block_table
    return make_batch(
        [t for c in chunks for t in c.token_ids],
        [c.start_pos for c in chunks],
        [len(c.token_ids) for c in chunks],
        block_tables,
        [c.sample for c in chunks],
        block_size,
    )


def scattered_batch(
    rng: np.random.Generator, runs: list[tuple[int, int]], block_size: int
) -> tuple[Batch, int]:
    """A batch of runs (tokens already cached, new tokens) per sequence whose blocks are scattered over a
    shuffled pool with a few spare blocks nobody uses; returns it and the pool's number of blocks."""
    needs = [-(-(start + n) // block_size) for start, n in runs]
    pool = rng.permutation(sum(needs) + 3)
    chunks, used = [], 0
    for (start, n), need in zip(runs, needs):
        chunks.append(ScheduledChunk(list(range(n)), start, [int(b) for b in pool[used : used + need]], True))
        used += need
    return build_batch(chunks, block_size), len(pool)


def forward_rows(model, cache, chunk: ScheduledChunk, block_size: int) -> np.ndarray:
    """Logits of every token of one sequence's chunk (the engine only asks for the last)."""
    batch = build_batch([chunk], block_size)
    batch.logits_indices = np.arange(batch.num_tokens, dtype=np.int32)
    return model.forward(batch, cache)


def prefill_then_greedy(model, prompt, new_tokens, block_size=16, chunk_size=None):
    """(logits float32[P, V] of the prompt, greedy tokens) for one sequence in contiguous blocks."""
    chunk_size = chunk_size or len(prompt)
    table = list(range(-(-(len(prompt) + new_tokens) // block_size)))
    cache = model.new_kv_cache(len(table), block_size)
    logits = np.concatenate(
        [
            forward_rows(model, cache, ScheduledChunk(prompt[i : i + chunk_size], i, table, True), block_size)
            for i in range(0, len(prompt), chunk_size)
        ]
    )
    ids = list(prompt) + [int(logits[-1].argmax())]
    while len(ids) < len(prompt) + new_tokens:
        step = model.forward(
            build_batch([ScheduledChunk(ids[-1:], len(ids) - 1, table, True)], block_size), cache
        )
        ids.append(int(step[0].argmax()))
    return logits, ids[len(prompt) :]


def relative_error(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def float64_logits(config, weights: dict, ids) -> np.ndarray:
    """float64[T, vocab] logits of one sequence `ids` from position 0: Hugging Face's Llama written plainly
    in float64 (no cache, no batch, half-split RoPE, grouped-query attention, SiLU MLP) over `weights`
    (Hugging Face names -> float arrays), the reference a checkpoint's dequantized weights are checked by."""
    c = config
    w = {name: np.asarray(array, dtype=np.float64) for name, array in weights.items()}
    T, D, Hq, Hk = len(ids), c.head_dim, c.num_attention_heads, c.num_key_value_heads

    def norm(x, gain):  # float64[T, H]
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + c.rms_norm_eps) * gain

    angle = np.arange(T, dtype=np.float64)[:, None, None] * c.rope_inv_freq().astype(
        np.float64
    )  # [T, 1, D/2]
    cos, sin = np.cos(angle), np.sin(angle)

    def rope(x):  # float64[T, heads, D]: pairs (x[i], x[i + D/2]) rotated
        a, b = x[..., : D // 2], x[..., D // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def project(x, name):
        return x @ w[name + ".weight"].T + w.get(name + ".bias", 0.0)

    causal = np.triu(np.full((T, T), -np.inf), 1)  # float64[T, T]
    x = w["model.embed_tokens.weight"][np.asarray(ids)]  # float64[T, H]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope(project(h, p + "self_attn.q_proj").reshape(T, Hq, D))
        k = rope(project(h, p + "self_attn.k_proj").reshape(T, Hk, D)).repeat(Hq // Hk, axis=1)
        v = project(h, p + "self_attn.v_proj").reshape(T, Hk, D).repeat(Hq // Hk, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + causal  # float64[Hq, T, T]
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        x = x + project(np.einsum("hts,shd->thd", probs, v).reshape(T, Hq * D), p + "self_attn.o_proj")
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = project(h, p + "mlp.gate_proj"), project(h, p + "mlp.up_proj")
        x = x + project(gate / (1 + np.exp(-gate)) * up, p + "mlp.down_proj")
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return norm(x, w["model.norm.weight"]) @ head.T
