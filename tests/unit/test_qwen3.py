"""Qwen3 (q/k norms, explicit head_dim) and YaRN against the transformers goldens of tests/golden/qwen3_*
(make_goldens.py), through the engine under every policy, and the config errors they bring."""

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends.devices import make_backend
from minisarathi.config import SCHEDULERS, ModelConfig
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import load_weights
from minisarathi.paths import default_model_dir
from minisarathi.testing import greedy_in_shared_batches, prefill_then_greedy, relative_error, sizes_to_run

GOLDEN = Path(__file__).parents[1] / "golden"


@pytest.mark.parametrize("device", ["cpu", "cuda-emulated"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("name", ["qwen3_yarn_tied", "qwen3_bf16"])
def test_greedy_tokens_equal_transformers_under_every_policy(name, scheduler, device, tmp_path):
    golden = np.load(GOLDEN / name / "golden.npz")
    # the engine needs a tokenizer: the bundled one (the ids are only detokenized, never encoded)
    model_dir = shutil.copytree(GOLDEN / name, tmp_path / name)
    shutil.copy(default_model_dir() / "tokenizer.json", model_dir)
    prompt, expected = golden["prompt"].tolist(), golden["greedy_tokens"].tolist()
    for chunk_size in sizes_to_run((1, 5, 64), scheduler, device):
        options = dict(scheduler=scheduler, chunk_size=chunk_size, block_size=4, device=device)
        tokens, _ = greedy_in_shared_batches(model_dir, prompt, len(expected), **options)
        assert tokens == expected, (chunk_size, tokens)


def _logits_error(config: ModelConfig, name: str) -> float:
    golden = np.load(GOLDEN / name / "golden.npz")
    model = LlamaModel(config, load_weights(GOLDEN / name, config), make_backend("cpu", "float32", False))
    logits, _ = prefill_then_greedy(model, golden["prompt"].tolist(), 1)
    return relative_error(logits, golden["logits"])


def test_yarn_and_its_attention_factor_are_what_the_goldens_need():
    config = ModelConfig.from_pretrained(GOLDEN / "qwen3_yarn_tied")
    assert config.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    assert _logits_error(config, "qwen3_yarn_tied") <= 1e-4
    unscaled = dataclasses.replace(config.rope_scaling, attention_factor=1.0)
    assert _logits_error(dataclasses.replace(config, rope_scaling=unscaled), "qwen3_yarn_tied") > 1e-2
    assert _logits_error(dataclasses.replace(config, rope_scaling=None), "qwen3_yarn_tied") > 1e-2


def test_yarn_inv_freq_matches_its_float64_formula():
    """Against YaRN's definition written independently: correction dims d(r) = D ln(L / 2 pi r) / 2 ln b,
    a ramp from floor(d(beta_fast)) to ceil(d(beta_slow)), interpolated (/ factor) above it."""
    config = ModelConfig.from_dict(
        {
            **_qwen3_dict(),
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 16,
            },
        }
    )
    D, base, L = config.head_dim, config.rope_theta, 4096
    inv = base ** -(np.arange(0, D, 2) / D)
    low = np.floor(D * np.log(L / (2 * np.pi * 16)) / (2 * np.log(base)))
    high = np.ceil(D * np.log(L / (2 * np.pi * 1)) / (2 * np.log(base)))
    ramp = np.clip((np.arange(D // 2) - low) / (high - low), 0, 1)
    expected = inv * (1 - ramp) + inv / 8 * ramp
    np.testing.assert_allclose(config.rope_inv_freq(), expected, rtol=1e-6)
    assert 0 < ramp.sum() < D // 2  # both ends of the ramp present


def _qwen3_dict() -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "sliding_window": 4096,  # ignored while use_sliding_window is false, as transformers does
        "use_sliding_window": False,
    }


def test_qwen3_config_reads_head_dim_and_qk_norm():
    config = ModelConfig.from_dict(_qwen3_dict())
    assert (config.head_dim, config.qk_norm, config.qkv_bias, config.o_bias) == (128, True, False, False)
    assert not ModelConfig.from_dict({**_qwen3_dict(), "architectures": ["Qwen2ForCausalLM"]}).qk_norm


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_sliding_window": True}, "use_sliding_window must be false"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_type must be one of"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "rope scaling factor must be a positive number"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}}, "beta_fast must be"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}}, "truncate must be true"),
    ],
)
def test_qwen3_config_errors(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**_qwen3_dict(), **change})
