import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from minisarathi.model.families import load_model
from minisarathi.paths import default_model_dir
from minisarathi.testing import ScheduledChunk, build_batch, prefill_then_greedy, relative_error

GOLDEN = Path(__file__).parents[1] / "golden"
# every folder make_goldens.py made (tests/golden/<name>/golden.npz)
GOLDEN_MODELS = sorted(path.parent.name for path in GOLDEN.glob("*/golden.npz"))


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
            chunks.append(
                ScheduledChunk(
                    tokens[s][cached[s] : cached[s] + n],
                    cached[s],
                    tables[s],
                    sample=cached[s] + n == len(tokens[s]),
                )
            )
            cached[s] += n
        q_lens = {len(c.token_ids) for c in chunks}
        mixed_steps += 1 in q_lens and len(q_lens) > 1
        logits = stories.forward(build_batch(chunks, block_size), cache)
        for row, s in enumerate(s for s, c in zip(chosen, chunks) if c.sample):
            sampled_logits[s].append(logits[row])
            tokens[s].append(int(logits[row].argmax()))
    assert mixed_steps > 0
    for s, (solo_logits, solo_tokens) in enumerate(solo):
        assert tokens[s][len(prompts[s]) :] == solo_tokens
        assert relative_error(sampled_logits[s][0], solo_logits[-1]) <= 1e-5


def test_kv_cache_shape_and_bytes(stories):
    cache = stories.new_kv_cache(num_blocks=3, block_size=16)
    assert len(cache) == 5 and cache[0][0].shape == (3, 4, 16, 8) and cache[0][1].dtype == np.float32
    assert stories.kv_cache_bytes_per_block(16) == 2 * 5 * 4 * 16 * 8 * 4
    with pytest.raises(ValueError, match="block_size"):
        stories.new_kv_cache(3, 0)


def test_load_model_rejects_unknown_device():
    with pytest.raises(ValueError, match="device"):
        load_model(default_model_dir(), device="tpu")
