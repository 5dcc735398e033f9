"""Embedding requests (model/pooling.py) against transformers' last-token embeddings of the random Qwen3
model tests/golden/qwen3_yarn_tied (make_embedding_goldens.py): run as prefill chunks in the same batches
as a greedy generation, whose tokens stay the golden's, under every policy, at two chunk sizes, on cpu and
cuda-emulated; and the errors they give."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from minisarathi.config import SCHEDULERS
from minisarathi.engine.engine import LLMEngine
from minisarathi.llm import LLM
from minisarathi.model.pooling import PoolingParams
from minisarathi.paths import default_model_dir
from minisarathi.sampling_params import SamplingParams

GOLDEN = Path(__file__).parents[1] / "golden" / "qwen3_yarn_tied"
EMBEDDINGS = np.load(GOLDEN / "embeddings.npz")
PROMPTS = [EMBEDDINGS[f"prompt_{i}"].tolist() for i in range(4)]
EXPECTED = [EMBEDDINGS[f"embedding_{i}"] for i in range(4)]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The golden model with the bundled tokenizer (its ids are never encoded here)."""
    folder = shutil.copytree(GOLDEN, tmp_path_factory.mktemp("qwen3") / "qwen3_yarn_tied")
    shutil.copy(default_model_dir() / "tokenizer.json", folder)
    return folder


def cosines(outputs, expected=EXPECTED) -> list[float]:
    return [float(np.dot(o.embedding, e) / np.linalg.norm(e)) for o, e in zip(outputs, expected)]


# The emulator (slow) runs the hybrid policy at the small chunk size, where a 1-token prompt's only chunk
# beside a decode makes a decode-shaped batch: its CUDA graph's final-norm rows are the ones pooled.
CASES = [("cpu", s, (5, 64)) for s in SCHEDULERS] + [
    pytest.param("cuda-emulated", "sarathi", (5,), marks=pytest.mark.system)
]


@pytest.mark.parametrize("device, scheduler, chunk_sizes", CASES)
def test_embeddings_match_transformers_in_batches_with_generation(model_dir, device, scheduler, chunk_sizes):
    golden = np.load(GOLDEN / "golden.npz")
    greedy = SamplingParams(temperature=0, max_tokens=len(golden["greedy_tokens"]), ignore_eos=True)
    for chunk_size in chunk_sizes:
        engine = LLMEngine(
            model_dir,
            device=device,
            scheduler=scheduler,
            chunk_size=chunk_size,
            block_size=4,
            num_kv_blocks=64,
            max_num_seqs=8,
        )
        engine.add_request("gen", golden["prompt"].tolist(), greedy, stream=False)
        engine.step()  # the generation's prompt goes first: the embeddings' chunks then join its decodes
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"embed-{i}", prompt, PoolingParams(), stream=False)
        done = {}
        while engine.has_unfinished_requests():
            done |= {out.request_id: out for out in engine.step() if out.finished}
            engine.check_invariants()
        assert done["gen"].outputs[0].token_ids == golden["greedy_tokens"].tolist(), chunk_size
        embedded = [done[f"embed-{i}"] for i in range(len(PROMPTS))]
        assert min(cosines(embedded)) >= MIN_COSINE, (chunk_size, cosines(embedded))
        assert all(o.outputs == [] and o.embedding.dtype == np.float32 for o in embedded)
        if scheduler in ("sarathi", "orca"):  # the hybrid policies: embedding prefill beside decodes
            assert any(r.num_prefill_tokens and r.num_decode_tokens for r in engine.step_records)
        assert engine.block_manager.num_used_blocks == 0  # every embedding request freed its blocks
        assert engine.num_generated_tokens == len(golden["greedy_tokens"])  # embeddings never sampled


def test_first_token_pooling_fails_the_goldens(model_dir):
    """The negative control: a causal model's first-token state is the first token embedded alone."""
    llm = LLM(model_dir, chunk_size=8, block_size=4)
    longer = [i for i, p in enumerate(PROMPTS) if len(p) > 1]
    first = llm.embed([PROMPTS[i][:1] for i in longer])
    assert max(cosines(first, [EXPECTED[i] for i in longer])) < 0.5


def test_overlap_dimensions_and_prefix_cache(model_dir):
    """The overlapping engine (a step's outputs one call later), Matryoshka truncation (the first d
    features, normalised after the cut), and a second embedding of a prompt served from the prefix cache."""
    llm = LLM(model_dir, chunk_size=8, block_size=4, overlap=True, enable_prefix_caching=True)
    assert min(cosines(llm.embed(PROMPTS))) >= MIN_COSINE
    again = llm.embed(PROMPTS[3], PoolingParams(dimensions=16))[0]
    assert again.num_cached_tokens > 0 and again.embedding.shape == (16,)
    assert float(np.linalg.norm(again.embedding)) == pytest.approx(1, abs=1e-6)
    assert cosines([again], [EXPECTED[3][:16]])[0] >= MIN_COSINE


def test_abort_mid_prefill_frees_its_blocks(model_dir):
    engine = LLMEngine(model_dir, chunk_size=8, block_size=4, num_kv_blocks=64)
    engine.add_request("e", PROMPTS[3], PoolingParams())
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort_request("e")
    (out,) = engine.step()
    assert out.finished and out.embedding is None and out.outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == 0


def test_a_base_model_checkpoint_embeds_alike(model_dir, tmp_path):
    """Qwen3-Embedding's layout: the base model's tensors, without "model." (and no lm_head, tied)."""
    base = shutil.copytree(model_dir, tmp_path / "base")
    tensors = safetensors.numpy.load_file(base / "model.safetensors")
    stripped = {n.removeprefix("model."): t for n, t in tensors.items() if n != "lm_head.weight"}
    assert "embed_tokens.weight" in stripped
    safetensors.numpy.save_file(stripped, base / "model.safetensors", metadata={"format": "pt"})
    assert min(cosines(LLM(base, chunk_size=8, block_size=4).embed(PROMPTS))) >= MIN_COSINE


def test_bad_embedding_requests_are_refused(model_dir):
    engine = LLMEngine(model_dir, chunk_size=8, block_size=4, num_kv_blocks=64, max_model_len=32)
    for prompt, params, message in [
        (PROMPTS[3], PoolingParams(), "more than max_model_len"),
        (PROMPTS[1], PoolingParams(dimensions=65), "hidden_size"),
        ([], PoolingParams(), "empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request("x", prompt, params)
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    assert not engine.has_unfinished_requests()
