"""Phi-3 (fused qkv_proj/gate_up_proj, partial rotary, LongRoPE) against the transformers golden of
tests/golden/phi3_longrope_partial (make_goldens.py): a 24-token prompt past the short context of 16, for
which transformers takes long_factor at every position, as the engine does."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends.devices import make_backend
from minisarathi.config import SCHEDULERS, ModelConfig
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import load_weights, read_checkpoint
from minisarathi.model.phi3 import checkpoint_tensors
from minisarathi.paths import default_model_dir
from minisarathi.testing import greedy_in_shared_batches, prefill_then_greedy, relative_error, sizes_to_run

NAME = "phi3_longrope_partial"
GOLDEN = Path(__file__).parents[1] / "golden" / NAME


@pytest.mark.parametrize("device", ["cpu", "cuda-emulated"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_greedy_tokens_equal_transformers_under_every_policy(scheduler, device, tmp_path):
    golden = np.load(GOLDEN / "golden.npz")
    model_dir = shutil.copytree(GOLDEN, tmp_path / NAME)
    shutil.copy(default_model_dir() / "tokenizer.json", model_dir)  # ids are only detokenized
    prompt, expected = golden["prompt"].tolist(), golden["greedy_tokens"].tolist()
    for chunk_size in sizes_to_run((1, 5, 64), scheduler, device):
        options = dict(scheduler=scheduler, chunk_size=chunk_size, block_size=4, device=device)
        tokens, _ = greedy_in_shared_batches(model_dir, prompt, len(expected), **options)
        assert tokens == expected, (chunk_size, tokens)


def _logits_error(config: ModelConfig) -> float:
    golden = np.load(GOLDEN / "golden.npz")
    model = LlamaModel(config, load_weights(GOLDEN, config), make_backend("cpu", "float32", False))
    logits, _ = prefill_then_greedy(model, golden["prompt"].tolist(), 1)
    return relative_error(logits, golden["logits"])


def test_logits_match_and_each_feature_is_needed():
    config = ModelConfig.from_pretrained(GOLDEN)
    scaling = config.rope_scaling
    assert (config.architecture, config.rotary_dim, config.head_dim) == ("Phi3ForCausalLM", 12, 16)
    assert scaling.ext_factors == (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # long_factor: 256 > 16
    assert scaling.attention_factor == pytest.approx(np.sqrt(1 + np.log(16) / np.log(16)))
    assert _logits_error(config) <= 1e-4

    def error_with(**scaling_fields):
        return _logits_error(
            dataclasses.replace(config, rope_scaling=dataclasses.replace(scaling, **scaling_fields))
        )

    assert error_with(ext_factors=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5)) > 1e-2  # short_factor
    assert error_with(attention_factor=1.0) > 1e-2
    # partial rotary off: all 16 dims turned, the two extra frequencies undivided
    full = dataclasses.replace(scaling, ext_factors=(*scaling.ext_factors, 1.0, 1.0))
    assert _logits_error(dataclasses.replace(config, rotary_dim=None, rope_scaling=full)) > 1e-2


def test_longrope_inv_freq_and_table_match_their_float64_formula():
    """inv_freq_i = 1 / (long_i * base^(2i/R)) for i < R/2, zero (cos 1, sin 0, unscaled) past it."""
    config = ModelConfig.from_pretrained(GOLDEN)
    R, D = 12, 16
    expected = 1 / (np.array(config.rope_scaling.ext_factors) * 10000.0 ** (np.arange(0, R, 2) / R))
    np.testing.assert_allclose(config.rope_inv_freq(), np.concatenate([expected, np.zeros(2)]), rtol=1e-6)
    table = config.rope_cos_sin()  # [P, D]: cos | sin
    p = 20
    np.testing.assert_allclose(table[p, : R // 2], np.sqrt(2) * np.cos(p * expected), rtol=1e-5)
    np.testing.assert_array_equal(table[p, R // 2 : D // 2], 1.0)
    np.testing.assert_array_equal(table[p, D // 2 + R // 2 :], 0.0)


def test_short_factor_when_the_context_stays_short():
    config = json.loads((GOLDEN / "config.json").read_text())
    short = ModelConfig.from_dict({**config, "max_position_embeddings": 16}).rope_scaling
    assert short.ext_factors == (1.0, 1.1, 1.2, 1.3, 1.4, 1.5) and short.attention_factor == 1.0


@pytest.mark.parametrize("legacy", ["su", "yarn"])
def test_legacy_rope_type_names_are_longrope_as_transformers_reads_them(legacy):
    config = json.loads((GOLDEN / "config.json").read_text())
    rope = {k: v for k, v in config.pop("rope_parameters").items() if k != "rope_type"}
    if legacy == "su":  # transformers 4's place for it, beside the rope dict
        config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    old = ModelConfig.from_dict({**config, "rope_scaling": {**rope, "type": legacy}})
    assert old == ModelConfig.from_pretrained(GOLDEN)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"short_factor": [1.0] * 5}, "short_factor must be a list of 6 positive numbers"),
        ({"long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, -1.0]}, "long_factor must be a list of 6"),
        ({"original_max_position_embeddings": None}, "original_max_position_embeddings must be"),
        ({"partial_rotary_factor": 0.7}, "partial_rotary_factor 0.7 gives 11 of head_dim 16"),
        ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor must be in \(0, 1\]"),
    ],
)
def test_config_errors(change, message):
    config = json.loads((GOLDEN / "config.json").read_text())
    config = {**config, "original_max_position_embeddings": None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**config, "rope_parameters": {**config["rope_parameters"], **change}})


def test_a_fused_tensor_of_the_wrong_shape_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    model_dir = shutil.copytree(GOLDEN, tmp_path / NAME)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.1.self_attn.qkv_proj.weight"] = tensors["model.layers.1.self_attn.qkv_proj.weight"][
        :-1
    ]
    save_file(tensors, model_dir / "model.safetensors")
    config = ModelConfig.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.qkv_proj.weight' has shape \[127, 64\]"):
        load_weights(model_dir, config)


def test_quantized_fused_tensors_are_refused():
    config = ModelConfig.from_pretrained(GOLDEN)
    tensors = read_checkpoint(GOLDEN)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    tensors[name] = dataclasses.replace(tensors[name], dtype="quantized")
    with pytest.raises(ValueError, match="quantized Phi3ForCausalLM checkpoints are not supported"):
        checkpoint_tensors(tensors, config)


def test_fused_tensors_become_views_of_the_stored_rows():
    config = ModelConfig.from_pretrained(GOLDEN)
    stored = read_checkpoint(GOLDEN)
    tensors = checkpoint_tensors(stored, config)
    fused = stored["model.layers.0.self_attn.qkv_proj.weight"].data
    assert "model.layers.0.self_attn.qkv_proj.weight" not in tensors
    for name in ("q_proj", "k_proj", "v_proj"):
        assert np.shares_memory(tensors[f"model.layers.0.self_attn.{name}.weight"].data, fused)
