"""Gemma 3 text (tests/golden/gemma3_sliding, made by make_goldens.py: two sliding layers with window 6 under
the 24-token prompt around a global one with linear RoPE scaling, soft-capped logits, tied embeddings) against
transformers: greedy tokens through the engine under every policy and chunk size on cpu and cuda-emulated,
logits at the goldens' tolerance, and each Gemma feature shown needed by switching it off."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends.devices import make_backend
from minisarathi.config import SCHEDULERS, ModelConfig
from minisarathi.model import gemma
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import load_weights
from minisarathi.paths import default_model_dir
from minisarathi.testing import greedy_in_shared_batches, prefill_then_greedy, relative_error, sizes_to_run

GOLDEN = Path(__file__).parents[1] / "golden" / "gemma3_sliding"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The golden folder with the bundled tokenizer (the ids are only detokenized, never encoded)."""
    folder = shutil.copytree(GOLDEN, tmp_path_factory.mktemp("g") / "gemma3_sliding")
    shutil.copy(default_model_dir() / "tokenizer.json", folder)
    return folder


@pytest.mark.parametrize("device", ["cpu", "cuda-emulated"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_greedy_tokens_equal_transformers_under_every_policy(model_dir, scheduler, device):
    golden = np.load(GOLDEN / "golden.npz")
    prompt, expected = golden["prompt"].tolist(), golden["greedy_tokens"].tolist()
    for chunk_size, block_size in sizes_to_run(((1, 4), (5, 2), (64, 16)), scheduler, device):
        options = dict(scheduler=scheduler, chunk_size=chunk_size, block_size=block_size, device=device)
        tokens, llm = greedy_in_shared_batches(model_dir, prompt, len(expected), **options)
        assert tokens == expected, (chunk_size, tokens)
        # mixed sliding and global layers: every block stays (the global layer reads them all)
        assert llm.engine.block_manager.window is None


def logits_error(config: ModelConfig, device: str = "cpu") -> float:
    model = gemma.Gemma3Model(config, load_weights(GOLDEN, config), make_backend(device, "float32", True))
    logits, _ = prefill_then_greedy(model, np.load(GOLDEN / "golden.npz")["prompt"].tolist(), 1)
    return relative_error(logits, np.load(GOLDEN / "golden.npz")["logits"])


@pytest.mark.parametrize("device", ["reference", "cpu", "cuda-emulated"])
def test_logits_match_transformers(device):
    assert logits_error(ModelConfig.from_pretrained(GOLDEN), device) <= 1e-4


def test_the_config_reads_gemmas_fields():
    c = ModelConfig.from_pretrained(GOLDEN)
    assert c.layer_windows == [6, None, 6] and c.kv_window is None and c.tie_word_embeddings
    assert (c.query_pre_attn_scalar, c.local_rope_theta, c.rope_theta) == (24, 100.0, 10000.0)
    assert c.rope_scaling.rope_type == "linear" and c.final_logit_softcapping == 8.0


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": None},  # the window off
        {"final_logit_softcapping": None},  # no soft-cap
        {"local_rope_theta": 10000.0},  # the global RoPE base on the sliding layers
        {"query_pre_attn_scalar": 16},  # the scale from head_dim
    ],
)
def test_each_config_feature_is_needed(change):
    assert logits_error(dataclasses.replace(ModelConfig.from_pretrained(GOLDEN), **change)) > 1e-2


def test_one_plus_w_and_the_embedding_scale_are_needed(monkeypatch):
    config = ModelConfig.from_pretrained(GOLDEN)
    with monkeypatch.context() as m:
        m.setattr(gemma, "NORMS", ())  # w, not 1 + w
        assert logits_error(config) > 1e-2
    monkeypatch.setattr(gemma, "scaled_embedding", lambda table, hidden: table)
    assert logits_error(config) > 1e-2


def gemma_dict(**changes) -> dict:
    return {**json.loads((GOLDEN / "config.json").read_text()), **changes}


def test_older_configs_rope_local_base_freq_and_the_pattern():
    """transformers 4's fields: rope_theta and rope_local_base_freq, sliding_window_pattern for the layers."""
    old = gemma_dict(rope_parameters=None, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=2)
    del old["layer_types"]
    c = ModelConfig.from_dict(old)
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling) == (1e6, 1e4, None)
    assert c.layer_windows == [6, None, 6]


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping", "50.0"]),
        ({"hidden_activation": "gelu"}, ["hidden_activation", "gelu"]),
        ({"layer_types": ["full_attention"]}, ["layer_types", "3"]),
        ({"layer_types": ["chunked_attention"] * 3}, ["layer_types"]),
        ({"sliding_window": 0}, ["sliding_window", "0"]),
        ({"use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
        ({"rope_parameters": {"full_attention": {}, "sliding_attention": {"rope_type": "yarn"}}}, ["yarn"]),
    ],
)
def test_unsupported_gemma_configs_name_the_field(changes, words):
    with pytest.raises(ValueError) as error:
        ModelConfig.from_dict(gemma_dict(**changes))
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("device", ["reference", "cpu", "cuda-emulated"])
def test_gemma_ops_against_float64(device):
    """GeGLU with tanh GELU and the soft-cap, on every backend, against their float64 formulas (and GeGLU
    is not silu's)."""
    ops = make_backend(device, "float32", True)
    rng = np.random.default_rng(0)
    x = (4 * rng.standard_normal((5, 2 * 24))).astype(np.float32)
    g, u = x[:, :24].astype(np.float64), x[:, 24:].astype(np.float64)
    want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    got = ops.to_numpy(ops.gelu_tanh_and_mul(ops.weight(x)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(ops.to_numpy(ops.silu_and_mul(ops.weight(x))) - want).max() > 0.1
    logits = (30 * rng.standard_normal((3, 40))).astype(np.float32)
    capped = ops.to_numpy(ops.softcap(ops.weight(logits), 8.0))
    np.testing.assert_allclose(capped, np.tanh(logits.astype(np.float64) / 8) * 8, rtol=1e-6, atol=1e-5)


def test_tensor_parallel_ranks_refuse_gemma():
    """The ranks build a LlamaModel (parallel/worker.py): Llama's forward on Gemma's weights."""
    config = ModelConfig.from_pretrained(GOLDEN)
    with pytest.raises(ValueError, match="Gemma 3 runs without tensor parallelism"):
        LlamaModel(config, load_weights(GOLDEN, config), make_backend("cpu", "float32", True))


def test_float16_on_the_emulated_tensor_core_prefill():
    """The prompt through prefill_attention.cu (float16, head_dim 16) with the sliding layers' window: near
    transformers' float32 logits (bfloat16 is within 3.3%), and far without the window."""
    from minisarathi.backends import cuda_ops

    config = ModelConfig.from_pretrained(GOLDEN)
    golden = np.load(GOLDEN / "golden.npz")

    def error(config):
        model = gemma.Gemma3Model(config, load_weights(GOLDEN, config), cuda_ops.emulated("float16"))
        logits, _ = prefill_then_greedy(model, golden["prompt"].tolist(), 1)
        return np.abs(logits - golden["logits"]).max() / np.abs(golden["logits"]).max()

    assert error(config) <= 0.01
    assert error(dataclasses.replace(config, sliding_window=None)) > 0.5
