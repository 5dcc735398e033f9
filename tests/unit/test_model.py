import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from minisarathi.backends.numpy_ops import NumpyOps
from minisarathi.config import rope_cos_sin_table
from minisarathi.model.llama import load_model
from minisarathi.paths import default_model_dir
from minisarathi.testing import ScheduledChunk, build_batch, forward_rows, prefill_then_greedy, relative_error

ops = NumpyOps()

GOLDEN = Path(__file__).parents[1] / "golden"
GOLDEN_MODELS = ["llama_gqa_bf16", "qwen2_tied", "llama3_rope_fp16", "mistral_mha", "llama_linear_rope_bias"]


@pytest.fixture(scope="module")
def stories():
    return load_model(default_model_dir())


def test_bundled_model_reproduces_the_readme_story(stories):
    readme = (default_model_dir() / "README.md").read_text()
    story = re.search(r"```text\n(.*?)\n```", readme, re.S).group(1)
    _, tokens = prefill_then_greedy(stories, [1], 200)
    tokenizer = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    assert tokenizer.decode([1] + tokens, skip_special_tokens=True) == story


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_matches_transformers_goldens(name, blas_core):
    golden = np.load(GOLDEN / name / "golden.npz")
    model = load_model(GOLDEN / name)
    logits, tokens = prefill_then_greedy(model, golden["prompt"].tolist(), len(golden["greedy_tokens"]))
    assert relative_error(logits, golden["logits"]) <= 1e-4
    assert tokens == golden["greedy_tokens"].tolist()


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_prefill_equals_full_prefill(stories, chunk_size, blas_core, monkeypatch):
    monkeypatch.setattr(stories.ops, "blas_core", blas_core)
    prompt = np.random.default_rng(0).integers(3, 512, 300).tolist()  # full prefill: 3 query tiles
    full_logits, full_tokens = prefill_then_greedy(stories, prompt, 20)
    chunk_logits, chunk_tokens = prefill_then_greedy(stories, prompt, 20, chunk_size=chunk_size)
    assert relative_error(chunk_logits, full_logits) <= 1e-5
    assert chunk_tokens == full_tokens


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batches_with_scattered_blocks_match_solo_runs(stories, block_size, blas_core, monkeypatch):
    """Sequences join at random steps and advance by random chunks, so prefills and decodes share batches."""
    monkeypatch.setattr(stories.ops, "blas_core", blas_core)
    rng = np.random.default_rng(block_size)
    prompts = [rng.integers(3, 512, n).tolist() for n in (37, 1, 12, 70)]
    new_tokens = 12
    solo = [prefill_then_greedy(stories, p, new_tokens) for p in prompts]

    lengths = [-(-(len(p) + new_tokens) // block_size) for p in prompts]
    pool = rng.permutation(sum(lengths) + 3).tolist()  # scattered, and some blocks never used
    tables = [[pool.pop() for _ in range(n)] for n in lengths]
    cache = stories.new_kv_cache(sum(lengths) + 3, block_size)
    tokens = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    sampled_logits = [[] for _ in prompts]
    mixed_steps = 0
    while any(len(t) < len(p) + new_tokens for t, p in zip(tokens, prompts)):
        running = [s for s in range(len(prompts)) if len(tokens[s]) < len(prompts[s]) + new_tokens]
        chosen = [s for s in running if rng.random() < 0.7] or running[:1]
        chunks = []
        for s in chosen:
            n = min(len(tokens[s]) - cached[s], int(rng.integers(1, 24)))
            chunks.append(ScheduledChunk(tokens[s][cached[s]:cached[s] + n], cached[s], tables[s],
                                         sample=cached[s] + n == len(tokens[s])))
            cached[s] += n
        q_lens = {len(c.token_ids) for c in chunks}
        mixed_steps += 1 in q_lens and len(q_lens) > 1
        logits = stories.forward(build_batch(chunks, block_size), cache)
        for row, s in enumerate(s for s, c in zip(chosen, chunks) if c.sample):
            sampled_logits[s].append(logits[row])
            tokens[s].append(int(logits[row].argmax()))
    assert mixed_steps > 0
    for s, (solo_logits, solo_tokens) in enumerate(solo):
        assert tokens[s][len(prompts[s]):] == solo_tokens
        assert relative_error(sampled_logits[s][0], solo_logits[-1]) <= 1e-5


# (history, query tokens) per sequence
RUNS = {"mixed": lambda block_size: [(0, 5), (7, 1), (13, 4), (0, 1), (30, 1), (2, 9), (block_size, 1),
                                     (block_size - 1, 1), (5, 300)],           # 300: several query tiles
        "equal decodes": lambda block_size: [(20, 1), (20, 1), (3, 6), (20, 1)],   # no padding mask
        "long decodes": lambda block_size: [(450, 1), (3, 6), (400, 1)]}          # scores computed transposed


@pytest.mark.parametrize("runs", RUNS)
@pytest.mark.parametrize("Hq, Hk, D, block_size", [(6, 2, 10, 3), (3, 3, 6, 5), (4, 1, 8, 1), (8, 4, 8, 16)])
def test_paged_attention_matches_dense_float64(Hq, Hk, D, block_size, runs):
    rng = np.random.default_rng(Hq * 100 + D)
    runs = RUNS[runs](block_size)
    lengths = [-(-(h + q) // block_size) for h, q in runs]
    num_blocks = sum(lengths) + 2
    pool = rng.permutation(num_blocks).tolist()
    tables = [[pool.pop() for _ in range(n)] for n in lengths]
    # Garbage everywhere first: slots no sequence owns must never change the result.
    k_cache = rng.standard_normal((num_blocks, Hk, block_size, D)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, Hk, block_size, D)).astype(np.float32)
    keys = [rng.standard_normal((h + q, Hk, D)).astype(np.float32) for h, q in runs]
    values = [rng.standard_normal((h + q, Hk, D)).astype(np.float32) for h, q in runs]
    whole = build_batch([ScheduledChunk([0] * (h + q), 0, t, True) for (h, q), t in zip(runs, tables)], block_size)
    ops.store_kv(np.concatenate(keys), np.concatenate(values), k_cache, v_cache, whole.slot_mapping)

    batch = build_batch([ScheduledChunk([0] * q, h, t, True) for (h, q), t in zip(runs, tables)], block_size)
    q = rng.standard_normal((batch.num_tokens, Hq, D)).astype(np.float32)
    scale = D ** -0.5
    out = ops.paged_attention(q, k_cache, v_cache, batch, scale)
    assert out.shape == (batch.num_tokens, Hq, D) and out.dtype == np.float32

    G = Hq // Hk
    for s, (h, n) in enumerate(runs):
        rows = slice(batch.query_start[s], batch.query_start[s + 1])
        for head in range(Hq):
            qs = q[rows, head].astype(np.float64)
            k, v = keys[s][:, head // G].astype(np.float64), values[s][:, head // G].astype(np.float64)
            scores = qs @ k.T * scale
            scores[np.arange(h + n)[None, :] > h + np.arange(n)[:, None]] = -np.inf
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            want = (p / p.sum(axis=1, keepdims=True)) @ v
            assert np.abs(out[rows, head] - want).max() < 1e-5


def test_store_kv_writes_the_mapped_slots():
    k_cache, v_cache = np.zeros((3, 2, 4, 5), np.float32), np.zeros((3, 2, 4, 5), np.float32)
    k = np.arange(2 * 2 * 5, dtype=np.float32).reshape(2, 2, 5)
    ops.store_kv(k, -k, k_cache, v_cache, np.array([9, 2], dtype=np.int32))
    assert np.array_equal(k_cache[2, :, 1], k[0]) and np.array_equal(k_cache[0, :, 2], k[1])
    assert np.array_equal(v_cache[2, :, 1], -k[0]) and np.count_nonzero(k_cache) == np.count_nonzero(k)
    before = k_cache.copy()
    ops.store_kv(k + 100, k, k_cache, v_cache, np.array([-1, 5], dtype=np.int32))   # a negative slot is padding
    assert np.array_equal(k_cache[1, :, 1], k[1] + 100)
    k_cache[1, :, 1] = before[1, :, 1]
    assert np.array_equal(k_cache, before)


def test_elementwise_ops_match_float64():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 12)).astype(np.float32)
    w = rng.standard_normal(12).astype(np.float32)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want_norm = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w64
    assert np.abs(ops.rms_norm(x, w, 1e-5) - want_norm).max() < 1e-5

    residual = rng.standard_normal((5, 12)).astype(np.float32)
    want_residual = residual.astype(np.float64) + x64
    normed, new_residual = ops.add_rms_norm(x, residual, w, 1e-5)
    assert new_residual is residual and np.abs(residual - want_residual).max() < 1e-6
    want = want_residual / np.sqrt((want_residual ** 2).mean(axis=1, keepdims=True) + 1e-5) * w64
    assert np.abs(normed - want).max() < 1e-5

    gate_up = rng.standard_normal((5, 8)).astype(np.float32) * 30
    g, u = gate_up[:, :4].astype(np.float64), gate_up[:, 4:].astype(np.float64)
    assert np.abs(ops.silu_and_mul(gate_up) - g / (1 + np.exp(-g)) * u).max() < 1e-4

    weight, bias = rng.standard_normal((7, 12)).astype(np.float32), rng.standard_normal(7).astype(np.float32)
    assert np.abs(ops.linear(x, weight, bias) - (x64 @ weight.T.astype(np.float64) + bias)).max() < 1e-5
    assert np.array_equal(ops.embedding(weight, np.array([3, 0, 3])), weight[[3, 0, 3]])


def test_rope_store_kv_rotates_q_in_place_and_stores_rotated_k_and_v():
    rng = np.random.default_rng(2)
    T, Hq, Hk, D, block_size = 6, 4, 2, 8, 4
    qkv = rng.standard_normal((T, (Hq + 2 * Hk) * D)).astype(np.float32)
    original = qkv.astype(np.float64)
    q, k, v = (qkv[:, :Hq * D].reshape(T, Hq, D), qkv[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D),
               qkv[:, (Hq + Hk) * D:].reshape(T, Hk, D))
    positions = np.array([0, 1, 2, 50, 51, 100000], dtype=np.int32)
    slots = np.array([3, 0, 9, -1, 4, 11], dtype=np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    k_cache, v_cache = ops.zeros((3, Hk, block_size, D)), ops.zeros((3, Hk, block_size, D))
    ops.rope_store_kv(q, k, v, k_cache, v_cache, positions, slots, ops.constant(rope_cos_sin_table(inv_freq, 100001)))
    angle = positions[:, None, None].astype(np.float64) * inv_freq.astype(np.float64)  # [T, 1, D/2]

    def rotated(start, heads):
        x = original[:, start:start + heads * D].reshape(T, heads, D)
        want = (x[..., :D // 2] + 1j * x[..., D // 2:]) * np.exp(1j * angle)   # half-split pairs as complex numbers
        return np.concatenate([want.real, want.imag], axis=-1)

    assert np.abs(q - rotated(0, Hq)).max() < 1e-4          # exact to float32 even at position 100000
    assert np.array_equal(qkv[:, Hq * D:], original[:, Hq * D:].astype(np.float32))   # k and v untouched
    want_k, want_v = np.zeros_like(k_cache), np.zeros_like(v_cache)
    for t, slot in enumerate(slots):
        if slot >= 0:                                        # -1: a padding token, stored nowhere
            want_k[slot // block_size, :, slot % block_size] = rotated(Hq * D, Hk)[t]
            want_v[slot // block_size, :, slot % block_size] = v[t]
    assert np.abs(k_cache - want_k).max() < 1e-4 and np.array_equal(v_cache, want_v)


def test_kv_cache_shape_and_bytes(stories):
    cache = stories.new_kv_cache(num_blocks=3, block_size=16)
    assert len(cache) == 5 and cache[0][0].shape == (3, 4, 16, 8) and cache[0][1].dtype == np.float32
    assert stories.kv_cache_bytes_per_block(16) == 2 * 5 * 4 * 16 * 8 * 4
    with pytest.raises(ValueError, match="block_size"):
        stories.new_kv_cache(3, 0)


def test_load_model_rejects_unknown_device():
    with pytest.raises(ValueError, match="device"):
        load_model(default_model_dir(), device="tpu")
