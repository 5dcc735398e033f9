"""Mistral with an active sliding window (tests/golden/mistral_sliding: window 6, a 24-token prompt, made by
make_goldens.py) against transformers through the engine under every policy and chunk size, and the KV cache
bound: blocks before the window go back to the pool, with and without prefix caching."""

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends.devices import make_backend
from minisarathi.config import SCHEDULERS, ModelConfig
from minisarathi.llm import LLM
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import load_weights
from minisarathi.paths import default_model_dir
from minisarathi.sampling_params import SamplingParams
from minisarathi.testing import greedy_in_shared_batches, prefill_then_greedy, relative_error, sizes_to_run

GOLDEN = Path(__file__).parents[1] / "golden" / "mistral_sliding"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The golden folder with the bundled tokenizer (the ids are only detokenized, never encoded)."""
    folder = shutil.copytree(GOLDEN, tmp_path_factory.mktemp("m") / "mistral_sliding")
    shutil.copy(default_model_dir() / "tokenizer.json", folder)
    return folder


def golden():
    data = np.load(GOLDEN / "golden.npz")
    return data["prompt"].tolist(), data["greedy_tokens"].tolist()


@pytest.mark.parametrize("device", ["cpu", "cuda-emulated"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_greedy_tokens_equal_transformers_under_every_policy(model_dir, scheduler, device):
    prompt, expected = golden()
    for chunk_size, block_size in sizes_to_run(((1, 4), (5, 2), (64, 16)), scheduler, device):
        options = dict(scheduler=scheduler, chunk_size=chunk_size, block_size=block_size, device=device)
        tokens, _ = greedy_in_shared_batches(model_dir, prompt, len(expected), **options)
        assert tokens == expected, (chunk_size, tokens)


def logits_error(config: ModelConfig) -> float:
    model = LlamaModel(config, load_weights(GOLDEN, config), make_backend("cpu", "float32", False))
    logits, _ = prefill_then_greedy(model, golden()[0], 1)
    return relative_error(logits, np.load(GOLDEN / "golden.npz")["logits"])


def test_logits_match_and_the_window_is_what_they_need():
    config = ModelConfig.from_pretrained(GOLDEN)
    assert config.layer_windows == [6, 6] and config.kv_window == 6
    assert logits_error(config) <= 1e-4
    assert logits_error(dataclasses.replace(config, sliding_window=None)) > 1e-2  # negative control
    assert logits_error(dataclasses.replace(config, sliding_window=7)) > 1e-2


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_kv_use_stays_bounded_by_the_window(model_dir, prefix_caching):
    """The 24-token prompt (4 windows) and its 16 new tokens in chunks of 4 over blocks of 2: at most the
    window's blocks, the chunk's and one partly before the window are held, never the 20 of the whole
    sequence; the same prompt again (a prefix-cache hit where enabled) gives the same tokens."""
    prompt, expected = golden()
    llm = LLM(
        model_dir,
        chunk_size=4,
        block_size=2,
        num_kv_blocks=64,
        max_model_len=64,
        enable_prefix_caching=prefix_caching,
    )
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=len(expected), ignore_eos=True)
    for run in range(2):
        engine.add_request(f"r{run}", prompt, params, stream=False)
        most, tokens = 0, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.outputs[0].token_ids
            engine.check_invariants()
            most = max(most, engine.block_manager.num_used_blocks)
        assert tokens == expected
        assert most <= 6 // 2 + 4 // 2 + 1, most
    if prefix_caching:
        assert engine.block_manager.prefix_hits > 0


@pytest.mark.parametrize("device", ["cpu", "cuda-emulated"])
def test_shared_prompts_with_freed_blocks(model_dir, device):
    """n = 2 forks a prompt whose first blocks are already freed (-1 entries are shared, never counted), two
    equal requests share cached blocks, and overlap schedules a step before the last one's blocks are freed:
    every choice is still transformers' greedy continuation, and the ref counts hold."""
    prompt, expected = golden()
    llm = LLM(
        model_dir,
        chunk_size=5,
        block_size=2,
        num_kv_blocks=64,
        max_model_len=64,
        device=device,
        dtype="float32",
        enable_prefix_caching=True,
        overlap=True,
    )
    params = SamplingParams(temperature=0, n=2, max_tokens=len(expected), ignore_eos=True)
    outputs = llm.generate([prompt, prompt], params)
    llm.engine.check_invariants()
    assert [choice.token_ids for out in outputs for choice in out.outputs] == [expected] * 4
