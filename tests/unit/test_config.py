import numpy as np
import pytest

from minisarathi.config import EngineConfig, ModelConfig, RopeScaling
from minisarathi.paths import default_model_dir

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def config(**changes) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **changes})


def test_bundled_model_config():
    c = ModelConfig.from_pretrained(default_model_dir())
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        64,
        5,
        8,
        4,
        8,
    )
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (512, 172, 512)
    assert c.tie_word_embeddings and c.rope_scaling is None and c.rope_theta == 10000.0
    assert c.dtype == "float32"


def test_defaults_and_biases():
    c = config()
    assert c.head_dim == 16 and c.rope_theta == 10000.0 and c.dtype == "float32" and not c.qkv_bias
    assert config(num_key_value_heads=None).num_key_value_heads == 4
    assert config(head_dim=32).head_dim == 32
    llama_bias = config(attention_bias=True)
    assert llama_bias.qkv_bias and llama_bias.o_bias
    qwen = config(architectures=["Qwen2ForCausalLM"], use_sliding_window=False, sliding_window=64)
    assert qwen.qkv_bias and not qwen.o_bias
    assert config(torch_dtype="bfloat16").dtype == "bfloat16" and config(dtype="float16").dtype == "float16"


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 2.0}, LLAMA3])
def test_rope_key_styles_read_identically(rope_scaling):
    v4 = config(rope_theta=500000.0, rope_scaling=rope_scaling)
    v5 = config(rope_parameters={"rope_theta": 500000.0, **(rope_scaling or {"rope_type": "default"})})
    old_type_key = config(
        rope_theta=500000.0,
        rope_scaling=rope_scaling and {"type" if k == "rope_type" else k: v for k, v in rope_scaling.items()},
    )
    assert v4 == v5 == old_type_key
    assert v4.rope_theta == 500000.0
    assert np.array_equal(v4.rope_inv_freq(), v5.rope_inv_freq())


def test_inv_freq_variants():
    default = config(rope_theta=500000.0).rope_inv_freq()
    expected = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)  # float64
    assert default.dtype == np.float32 and default.shape == (8,)
    assert np.array_equal(default, expected.astype(np.float32))
    linear = config(rope_theta=500000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}).rope_inv_freq()
    assert np.array_equal(linear, (expected / 4).astype(np.float32))
    llama3 = config(rope_theta=500000.0, rope_scaling=LLAMA3).rope_inv_freq()
    wavelen = 2 * np.pi / expected
    short, long_ = wavelen < 64 / 4, wavelen > 64 / 1
    assert short.any() and long_.any() and (~short & ~long_).any()
    assert np.array_equal(llama3[short], default[short])  # high frequencies untouched
    assert np.allclose(llama3[long_], default[long_] / 8, rtol=1e-6)  # low ones slowed by factor
    medium = ~short & ~long_
    assert np.all(llama3[medium] < default[medium]) and np.all(llama3[medium] > default[medium] / 8)


def test_mistral_window_covering_everything_is_full_attention():
    for window in (None, 256, 1000):
        full = config(architectures=["MistralForCausalLM"], sliding_window=window)
        assert full.sliding_window is None and full.layer_windows == [None] * full.num_hidden_layers
    sliding = config(architectures=["MistralForCausalLM"], sliding_window=128)
    assert sliding.layer_windows == [128] * sliding.num_hidden_layers and sliding.kv_window == 128


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, ["architectures", "GPT2LMHeadModel"]),
        ({"architectures": None}, ["architectures"]),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, ["sliding_window", "0"]),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4.5}, ["sliding_window", "4.5"]),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, ["use_sliding_window", "True"]),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}}, ["truncate", "False"]),
        ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, ["rope_type", "mrope"]),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, ["factor", "None"]),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["low_freq_factor"]),
        ({"rope_scaling": {"rope_type": "linear"}}, ["factor", "None"]),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, ["quant_method", "bitsandbytes"]),
        ({"mlp_bias": True}, ["mlp_bias", "True"]),
        ({"hidden_act": "gelu"}, ["hidden_act", "gelu"]),
        ({"num_key_value_heads": 3}, ["num_key_value_heads", "3"]),
        ({"hidden_size": 0}, ["hidden_size", "0"]),
        ({"dtype": "float8_e4m3fn"}, ["dtype", "float8_e4m3fn"]),
        ({"head_dim": 7}, ["head_dim", "7"]),
    ],
)
def test_unsupported_configs_name_the_field(changes, words):
    with pytest.raises(ValueError) as error:
        config(**changes)
    for word in words:
        assert word in str(error.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_rope_scaling_is_a_value():
    assert config(rope_scaling=LLAMA3).rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)


def test_engine_config_checks_its_fields():
    assert (
        EngineConfig().kv_cache_bytes is None
        and EngineConfig(kv_cache_bytes=1 << 20).kv_cache_bytes == 1 << 20
    )
    for bad in (
        {"kv_cache_bytes": 0},
        {"kv_cache_bytes": True},
        {"num_kv_blocks": -1},
        {"chunk_size": 0},
        {"device": "tpu"},
        {"scheduler": "fifo"},
        {"seed": -1},
        {"max_num_seqs": None},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)


def test_scheduling_options_are_checked():
    from minisarathi.config import EngineConfig

    EngineConfig(
        tbt_slo_ms=50, max_partial_prefills=4, long_prefill_threshold=2048, max_long_partial_prefills=2
    )
    for options, field in [
        (dict(tbt_slo_ms=0), "tbt_slo_ms"),
        (dict(tbt_slo_ms="50"), "tbt_slo_ms"),
        (dict(tbt_slo_ms=50, scheduler="vllm"), "tbt_slo_ms"),
        (dict(max_partial_prefills=0), "max_partial_prefills"),
        (dict(long_prefill_threshold=64), "long_prefill_threshold"),
        (dict(max_partial_prefills=2, scheduler="orca"), "max_partial_prefills"),
        (dict(max_partial_prefills=2, max_long_partial_prefills=3), "max_long_partial_prefills"),
        (dict(priority_aging_s=-1), "priority_aging_s"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**options)
