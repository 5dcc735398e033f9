"""Batches built by hand and the checks on them, for tests and benchmark scripts that drive the model without
the engine; float32's fused multiply-add in NumPy, for tests that emulate native kernels bit for bit."""

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


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once, as a fused multiply-add: the product is exact in float64, the sum's
    error is recovered exactly (TwoSum) and folded in by rounding to odd, so rounding to float32 after is
    the single rounding of the exact value."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c = np.asarray(c, np.float64)
    s = p + c
    t = s - p
    err = (p - (s - t)) + (c - t)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def float64_logits(config, weights, token_ids) -> np.ndarray:
    """float64[T, V]: the logits of every position of one sequence, by a plain float64 forward over the
    float32 values of `weights` (load_weights' names, fused; quantized ones dequantized): full causal
    attention with no cache, written apart from the backends so it can check any of them."""
    c = config

    def w(name):
        return np.asarray(weights[name], dtype=np.float32).astype(np.float64)

    def rms_norm(x, weight):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + c.rms_norm_eps) * weight

    T, D, Hq, Hk = len(token_ids), c.head_dim, c.num_attention_heads, c.num_key_value_heads
    inv_freq = c.rope_inv_freq().astype(np.float64)  # float64[D/2], the model's frequencies
    angles = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]  # float64[T, D/2]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]  # float64[T, 1, D/2]

    def rope(x):  # float64[T, heads, D], HF's rotate_half pairs (i, i + D/2)
        first, second = x[..., : D // 2], x[..., D // 2 :]
        return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)

    x = w("embed_tokens")[np.asarray(token_ids)]  # float64[T, H]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        qkv = rms_norm(x, w(p + "input_layernorm")) @ w(p + "qkv_proj").T
        if c.qkv_bias:
            qkv = qkv + w(p + "qkv_bias")
        q = rope(qkv[:, : Hq * D].reshape(T, Hq, D))
        k = rope(qkv[:, Hq * D : (Hq + Hk) * D].reshape(T, Hk, D))
        v = qkv[:, (Hq + Hk) * D :].reshape(T, Hk, D)
        k, v = np.repeat(k, Hq // Hk, axis=1), np.repeat(v, Hq // Hk, axis=1)  # float64[T, Hq, D]
        scores = np.where(causal, np.einsum("thd,shd->hts", q, k) / np.sqrt(D), -np.inf)  # [Hq, T, T]
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attention = np.einsum("hts,shd->thd", probs, v).reshape(T, Hq * D) @ w(p + "o_proj").T
        x = x + (attention + w(p + "o_bias") if c.o_bias else attention)
        gate_up = rms_norm(x, w(p + "post_attention_layernorm")) @ w(p + "gate_up_proj").T
        gate, up = gate_up[:, : c.intermediate_size], gate_up[:, c.intermediate_size :]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w(p + "down_proj").T
    head = w("embed_tokens") if c.tie_word_embeddings else w("lm_head")
    return rms_norm(x, w("norm")) @ head.T


class FakeClock:
    """A time.monotonic stand-in that tests move by hand (`clock.now += 5`)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def greedy_in_shared_batches(model_dir, prompt: list[int], max_tokens: int, **engine_options):
    """(greedy tokens of `prompt`, the LLM that ran them): in float32, the goldens' dtype (a bf16 run may flip
    a near tie), beside a second, shorter prompt so that the two share batches."""
    from minisarathi.llm import LLM
    from minisarathi.sampling_params import SamplingParams

    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_model_len=64, **engine_options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt, prompt[:7]], params)[0].outputs[0].token_ids, llm


def sizes_to_run(sizes: tuple, scheduler: str, device: str) -> tuple:
    """Every one of `sizes` (chunk sizes, or (chunk, block) pairs) on the CPU; on the CUDA emulator, whose
    kernels run far slower, one per policy in turn, so that the policies together still cover every size."""
    from minisarathi.config import SCHEDULERS

    return sizes if device == "cpu" else (sizes[SCHEDULERS.index(scheduler) % len(sizes)],)
