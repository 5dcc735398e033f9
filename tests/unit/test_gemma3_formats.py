"""Gemma 3 in its other checkpoint forms: a GGUF `gemma3` file written as llama.cpp's converter writes it
(tests/golden/make_gguf.py: 1 + w norms, llama.cpp's tensor names) gives the safetensors folder's logits,
and a Gemma3ForConditionalGeneration folder (text_config, language-model prefixes, vision tensors beside)
gives transformers' logits for the tests/golden/gemma3_sliding weights."""

import dataclasses
import importlib.util
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from safetensors.numpy import save_file

from minisarathi.backends.devices import make_backend
from minisarathi.config import ModelConfig
from minisarathi.model.gemma import Gemma3Model
from minisarathi.model.loader import load_weights, read_checkpoint
from minisarathi.quant.gguf_file import gemma3_config
from minisarathi.testing import prefill_then_greedy, relative_error

ROOT = Path(__file__).parents[2]
GOLDEN = ROOT / "tests" / "golden" / "gemma3_sliding"
_spec = importlib.util.spec_from_file_location("make_gguf", ROOT / "tests" / "golden" / "make_gguf.py")
make_gguf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_gguf)


def golden_arrays() -> dict[str, np.ndarray]:
    return {name: np.asarray(t, dtype=np.float32) for name, t in read_checkpoint(GOLDEN).items()}


def logits(path: Path, config: ModelConfig | None = None, device: str = "cpu") -> np.ndarray:
    config = config or ModelConfig.from_pretrained(path)
    model = Gemma3Model(config, load_weights(path, config), make_backend(device, "float32", True))
    return prefill_then_greedy(model, np.load(GOLDEN / "golden.npz")["prompt"].tolist(), 1)[0]


@pytest.fixture(scope="module")
def llamacpp_folder(tmp_path_factory) -> Path:
    """The golden's weights as a six-layer model (layer i is the golden's i % 3) with the choices llama.cpp
    makes for every gemma3 file: each sixth layer global, RoPE base 10000 on the others, the attention
    scale from head_dim. The golden's own config (local base 100, query_pre_attn_scalar 24) has no GGUF
    form."""
    folder = tmp_path_factory.mktemp("gemma3") / "gemma3_six"
    folder.mkdir()
    weights = {}
    for name, array in golden_arrays().items():
        parts = name.split(".")
        if parts[1] != "layers":
            weights[name] = array
            continue
        for i in range(int(parts[2]), 6, 3):
            weights[".".join([*parts[:2], str(i), *parts[3:]])] = array
    save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((GOLDEN / "config.json").read_text())
    del config["layer_types"], config["_sliding_window_pattern"]  # every sixth layer global
    config["rope_parameters"]["sliding_attention"]["rope_theta"] = 10000.0
    config.update(num_hidden_layers=6, query_pre_attn_scalar=config["head_dim"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def gguf_file(llamacpp_folder) -> Path:
    return make_gguf.write_gguf(
        llamacpp_folder, llamacpp_folder.parent / "gemma3.gguf", T.F32, tokenizer=False
    )


def test_gguf_config_is_the_folders_with_its_norms_marked(llamacpp_folder, gguf_file):
    folder, gguf = ModelConfig.from_pretrained(llamacpp_folder), ModelConfig.from_pretrained(gguf_file)
    assert gguf.layer_windows == [6, 6, 6, 6, 6, None] and gguf.norms_include_one
    assert gguf == dataclasses.replace(folder, norms_include_one=True)


def test_gguf_logits_equal_the_folders_and_adding_one_twice_fails(llamacpp_folder, gguf_file):
    expected = logits(llamacpp_folder)
    assert np.array_equal(logits(gguf_file), expected)  # the same float32 1 + w, the same sums
    twice = dataclasses.replace(ModelConfig.from_pretrained(gguf_file), norms_include_one=False)
    assert relative_error(logits(gguf_file, twice), expected) > 1e-2


def test_gguf_q8_0_is_the_folder_of_its_dequantized_weights(llamacpp_folder, gguf_file, tmp_path):
    """Q8_0 matrices and embedding table (dequantized and scaled at load): the model of the file's
    dequantized values, its norms less the 1 the converter added."""
    q8 = make_gguf.write_gguf(llamacpp_folder, tmp_path / "q8.gguf", T.Q8_0, tokenizer=False)
    folder = tmp_path / "dequantized"
    folder.mkdir()
    shutil.copy(llamacpp_folder / "config.json", folder)
    weights = {n: np.asarray(t, dtype=np.float32) for n, t in read_checkpoint(q8).items()}
    weights = {n: a - np.float32(n.endswith("norm.weight")) for n, a in weights.items()}
    save_file(weights, str(folder / "model.safetensors"))
    # the NumPy reference multiplies by the dequantized weights (the cpu kernels quantize activations too)
    assert relative_error(logits(q8, device="reference"), logits(folder, device="reference")) <= 1e-5
    assert (
        relative_error(logits(q8), logits(llamacpp_folder)) > 1e-3
    )  # the file's weights are not the folder's


def test_gguf_gemma3_fields_as_llamacpp_reads_them():
    base = {"num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32, "head_dim": 128}
    base["max_position_embeddings"] = 131072
    big = gemma3_config({"gemma3.attention.sliding_window": 1024}, base)
    assert big["query_pre_attn_scalar"] == 168 and big["layer_types"][4:6] == [
        "sliding_attention",
        "full_attention",
    ]
    small = gemma3_config(
        {}, {**base, "num_hidden_layers": 26}
    )  # no window: every layer full, head_dim scale
    assert small["query_pre_attn_scalar"] == 128 and set(small["layer_types"]) == {"full_attention"}
    assert small["final_logit_softcapping"] is None and small["rope_local_base_freq"] == 10000.0


def multimodal_folder(tmp_path: Path, prefix: str) -> Path:
    """The golden's weights under `prefix` as Gemma3ForConditionalGeneration keeps them, a vision tower's
    and projector's tensors beside, its config under text_config."""
    folder = tmp_path / "gemma3_mm"
    folder.mkdir()
    weights = {prefix + name.removeprefix("model."): a for name, a in golden_arrays().items()}
    outer = prefix.removesuffix("model.")  # the multimodal model's own prefix: "model." or none
    for name in ("vision_tower.vision_model.embeddings.patch_embedding.weight", "multi_modal_projector.w"):
        weights[outer.replace("language_model.", "") + name] = np.ones((4, 3), np.float32)
    save_file(weights, str(folder / "model.safetensors"))
    text = json.loads((GOLDEN / "config.json").read_text())
    del text["architectures"]
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
    }
    config["vision_config"] = {"model_type": "siglip_vision_model", "hidden_size": 4}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])  # transformers 5, 4
def test_conditional_generation_folder_gives_transformers_logits(tmp_path, prefix, caplog):
    folder = multimodal_folder(tmp_path, prefix)
    with caplog.at_level(logging.INFO, logger="minisarathi.loader"):
        error = relative_error(logits(folder), np.load(GOLDEN / "golden.npz")["logits"])
    assert error <= 1e-4
    assert "2 others (vision) ignored" in caplog.text


def test_conditional_generation_without_the_text_prefix_is_a_missing_tensor(tmp_path):
    folder = multimodal_folder(tmp_path, "text_model.")
    with pytest.raises(ValueError, match="model.embed_tokens.weight.* is missing"):
        logits(folder)


def test_a_sparse_text_config_takes_transformers_defaults():
    """google/gemma-3-4b-it's config: text_config names five fields, the dtype is beside it."""
    text = {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "sliding_window": 1024}
    text["rope_scaling"] = {"factor": 8.0, "rope_type": "linear"}
    config = ModelConfig.from_dict(
        {"architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16", "text_config": text}
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 256)
    assert (config.vocab_size, config.rope_theta, config.local_rope_theta) == (262208, 1e6, 1e4)
    assert config.rope_scaling.factor == 8.0 and config.dtype == "bfloat16" and config.multimodal
    assert config.layer_windows[4:7] == [1024, None, 1024] and config.query_pre_attn_scalar == 256
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"]})


def test_the_multimodal_folder_serves(tmp_path):
    from minisarathi.llm import LLM
    from minisarathi.paths import default_model_dir
    from minisarathi.sampling_params import SamplingParams

    folder = multimodal_folder(tmp_path, "model.language_model.")
    shutil.copy(default_model_dir() / "tokenizer.json", folder)
    golden = np.load(GOLDEN / "golden.npz")
    expected = golden["greedy_tokens"].tolist()
    llm = LLM(folder, chunk_size=5, block_size=4, dtype="float32", num_kv_blocks=64, max_model_len=64)
    out = llm.generate(
        [golden["prompt"].tolist()], SamplingParams(temperature=0, max_tokens=len(expected), ignore_eos=True)
    )
    assert out[0].outputs[0].token_ids == expected
