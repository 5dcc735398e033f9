import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from minisarathi.config import ModelConfig
from minisarathi.dtypes import bf16_to_float32, to_float32
from minisarathi.model.loader import load_weights, read_checkpoint

GOLDEN = Path(__file__).parents[1] / "golden"


def float_from_bits(bits: np.ndarray, exponent_bits: int, mantissa_bits: int) -> np.ndarray:
    """float64 value of each IEEE bit pattern, from the formula (the reference for the conversions)."""
    bits = bits.astype(np.int64)
    sign = np.where(bits >> (exponent_bits + mantissa_bits) & 1, -1.0, 1.0)
    exponent = bits >> mantissa_bits & ((1 << exponent_bits) - 1)
    mantissa = (bits & ((1 << mantissa_bits) - 1)) / 2.0**mantissa_bits
    bias = (1 << (exponent_bits - 1)) - 1
    normal = np.ldexp(1 + mantissa, exponent - bias)
    subnormal = np.ldexp(mantissa, 1 - bias)
    inf = np.full(bits.shape, np.inf)
    top = (1 << exponent_bits) - 1
    return sign * np.where(exponent == 0, subnormal, np.where(exponent == top, inf, normal))


@pytest.mark.parametrize("dtype, exponent_bits, mantissa_bits", [("bfloat16", 8, 7), ("float16", 5, 10)])
def test_16_bit_conversion_is_exact_for_every_value(dtype, exponent_bits, mantissa_bits):
    bits = np.arange(1 << 16, dtype=np.uint16)
    raw = bits if dtype == "bfloat16" else bits.view(np.float16)
    got = to_float32(raw, dtype)
    want = float_from_bits(bits, exponent_bits, mantissa_bits)
    is_nan = (bits >> mantissa_bits & ((1 << exponent_bits) - 1)) == (1 << exponent_bits) - 1
    is_nan &= (bits & ((1 << mantissa_bits) - 1)) != 0
    assert got.dtype == np.float32
    assert np.array_equal(got[~is_nan].astype(np.float64), want[~is_nan])
    assert np.isnan(got[is_nan]).all()


def test_bf16_known_values():
    bits = np.array([0x3F80, 0xC000, 0x0000, 0x8000, 0x7F80, 0x0001, 0x4049], dtype=np.uint16)
    assert bf16_to_float32(bits).tolist() == [1.0, -2.0, 0.0, -0.0, np.inf, 2.0**-133, 3.140625]


def test_sharded_bf16_checkpoint_reads_every_tensor():
    index = json.loads((GOLDEN / "llama_gqa_bf16" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    stored = read_checkpoint(GOLDEN / "llama_gqa_bf16")
    assert set(stored) == set(index["weight_map"])
    assert {t.dtype for t in stored.values()} == {"bfloat16"}
    assert all(
        t.data.dtype == np.uint16 and not t.data.flags.writeable for t in stored.values()
    )  # raw bits, mapped


def test_fusion_and_tied_embeddings():
    path = GOLDEN / "qwen2_tied"  # float32, so safetensors' own numpy loader is an independent reference
    config = ModelConfig.from_pretrained(path)
    ref = load_file(path / "model.safetensors")
    weights = load_weights(path, config)
    assert "lm_head" not in weights and "lm_head.weight" not in ref
    attn = "model.layers.1.self_attn."
    assert np.array_equal(
        weights["layers.1.qkv_proj"], np.concatenate([ref[attn + p + "_proj.weight"] for p in "qkv"])
    )
    assert np.array_equal(
        weights["layers.1.qkv_bias"], np.concatenate([ref[attn + p + "_proj.bias"] for p in "qkv"])
    )
    mlp = "model.layers.0.mlp."
    assert np.array_equal(
        weights["layers.0.gate_up_proj"],
        np.concatenate([ref[mlp + "gate_proj.weight"], ref[mlp + "up_proj.weight"]]),
    )
    assert np.array_equal(weights["embed_tokens"], ref["model.embed_tokens.weight"])
    assert all(w.dtype == "float32" and np.asarray(w).dtype == np.float32 for w in weights.values())


def test_bf16_weights_stay_raw_bits_and_fuse_bit_exactly():
    path = GOLDEN / "llama_gqa_bf16"
    stored = read_checkpoint(path)
    weights = load_weights(path, ModelConfig.from_pretrained(path))
    assert {w.dtype for w in weights.values()} == {"bfloat16"}
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    qkv = weights["layers.1.qkv_proj"]
    assert qkv.data.dtype == np.uint16
    assert np.array_equal(qkv.data, np.concatenate([stored[attn + p + "_proj.weight"].data for p in "qkv"]))
    assert np.array_equal(
        weights["layers.1.gate_up_proj"].data,
        np.concatenate([stored[mlp + p + "_proj.weight"].data for p in ("gate", "up")]),
    )
    down = weights["layers.1.down_proj"].data
    assert not down.flags.writeable and np.array_equal(
        down, stored[mlp + "down_proj.weight"].data
    )  # the map itself
    assert np.array_equal(np.asarray(qkv), bf16_to_float32(qkv.data))  # NumPy code sees float32 values


def copy_with(tmp_path: Path, edit) -> tuple[Path, ModelConfig]:
    """qwen2_tied copied to tmp_path with its tensors dict changed by edit(tensors)."""
    src = GOLDEN / "qwen2_tied"
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path, ModelConfig.from_pretrained(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    path, config = copy_with(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*missing"):
        load_weights(path, config)


def test_wrong_shape_is_named(tmp_path):
    def edit(t):
        t["model.layers.0.mlp.down_proj.weight"] = np.zeros((64, 63), dtype=np.float32)

    path, config = copy_with(tmp_path, edit)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\[64, 63\].*\[64, 64\]"):
        load_weights(path, config)


def test_fused_tensors_must_share_a_dtype(tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"].astype(
            np.float16
        )

    path, config = copy_with(tmp_path, edit)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*layers\.0\.qkv_proj.*float32, float16, float32"):
        load_weights(path, config)


def test_untied_model_needs_lm_head(tmp_path):
    path, _ = copy_with(tmp_path, lambda t: None)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_weights(path, ModelConfig.from_dict(config))


def test_unsupported_dtype_and_bad_files(tmp_path):
    save_file({"x": np.zeros(4, dtype=np.int8)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="I8"):
        read_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="header"):
        read_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model_dir"):
        read_checkpoint(tmp_path)
