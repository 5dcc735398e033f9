"""GGUF files as models (minisarathi/quant/gguf_file.py): the bundled stories260K GGUF copies, written by
tests/golden/make_gguf.py as llama.cpp's converter would, against the safetensors folder they came from."""

import dataclasses
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

import minisarathi.model.loader as loader  # noqa: E402
from minisarathi import LLM, SamplingParams  # noqa: E402
from minisarathi.cli import main  # noqa: E402
from minisarathi.config import ModelConfig  # noqa: E402
from minisarathi.dtypes import convert, to_float32  # noqa: E402
from minisarathi.model.families import load_model  # noqa: E402
from minisarathi.model.loader import load_weights  # noqa: E402
from minisarathi.quant.gguf_file import UnsupportedGGUF, hf_name, read_gguf  # noqa: E402
from minisarathi.quant.layouts import IntGroups, UnsupportedTensorType  # noqa: E402
from minisarathi.testing import prefill_then_greedy, relative_error  # noqa: E402
from minisarathi.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).parents[2]
SAFETENSORS = ROOT / "models" / "stories260K"
F32 = ROOT / "models" / "stories260K-gguf" / "stories260K-f32.gguf"
Q8_0 = ROOT / "models" / "stories260K-gguf" / "stories260K-q8_0.gguf"
PROMPT = [1, 403, 407]  # "Once upon a time"
# Q8_0's top-1 agreement with float32 over the README story's 201 positions: measured 0.990 (199 of 201)
Q8_0_MIN_AGREEMENT = 0.97
# No text that starts with a space or follows a special token: there llama.cpp prefixes "▁" (as the file's
# tokenizer does; tests/unit/test_gguf_tokenizer.py checks it on Llama 2's vocabulary), tokenizer.json not
TEXTS = [
    "Once upon a time",
    "Lily's mom said, \"Lily, let's go!\"\nThe end.",
    "dragon ö 株 🙂",
    "",
    "hi</s>",
]

_spec = importlib.util.spec_from_file_location("make_gguf", ROOT / "tests" / "golden" / "make_gguf.py")
make_gguf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_gguf)


@pytest.fixture(scope="module")
def fp32():
    return load_model(SAFETENSORS)


@pytest.fixture(scope="module")
def story_ids():
    story = re.search(r"```text\n(.*?)\n```", (SAFETENSORS / "README.md").read_text(), re.S).group(1)
    return Tokenizer.from_pretrained(SAFETENSORS).encode(story)


def test_bundled_files_are_what_the_script_writes(tmp_path):
    for path, qtype in ((F32, T.F32), (Q8_0, T.Q8_0)):
        written = make_gguf.write_gguf(SAFETENSORS, tmp_path / path.name, qtype)
        assert written.read_bytes() == path.read_bytes(), path.name


def test_config_from_the_metadata_equals_config_json():
    assert ModelConfig.from_pretrained(F32) == ModelConfig.from_pretrained(SAFETENSORS)
    assert ModelConfig.from_pretrained(Q8_0) == ModelConfig.from_pretrained(SAFETENSORS)


def test_f32_file_gives_the_safetensors_model_bit_for_bit(fp32):
    config = ModelConfig.from_pretrained(SAFETENSORS)
    want, got = load_weights(SAFETENSORS, config), load_weights(F32, config)
    assert set(got) == set(want)
    for name in want:
        assert np.array_equal(np.asarray(got[name]), np.asarray(want[name])), name
    model = load_model(F32)
    want_logits, want_tokens = prefill_then_greedy(fp32, PROMPT, 48)
    got_logits, got_tokens = prefill_then_greedy(model, PROMPT, 48)
    assert got_tokens == want_tokens
    assert relative_error(got_logits, want_logits) <= 1e-6


@pytest.mark.parametrize(
    "name", ["qwen2_tied", "llama_linear_rope_bias", "llama_gqa_bf16", "qwen3_yarn_tied", "qwen3_bf16"]
)
def test_golden_folders_through_gguf_give_their_weights(tmp_path, name):
    # qwen2 (not reordered, q/k/v biases), linear RoPE scaling with attention biases, bf16 weights; qwen3's
    # q/k norms and YaRN
    folder = ROOT / "tests" / "golden" / name
    path = make_gguf.write_gguf(folder, tmp_path / f"{name}.gguf", T.F32, tokenizer=False)
    config = ModelConfig.from_pretrained(folder)
    assert ModelConfig.from_pretrained(path) == dataclasses.replace(config, dtype="float32")
    want, got = load_weights(folder, config), load_weights(path, config)
    assert set(got) == set(want)
    for key in want:
        assert np.array_equal(np.asarray(got[key]), np.asarray(want[key])), key


def test_without_restoring_the_rope_order_the_tokens_change(fp32, monkeypatch):
    stored = read_gguf(F32, restore_rope_order=False)
    stored = {name: loader.CheckpointTensor("float32", data) for name, data in stored.items()}
    monkeypatch.setattr(loader, "read_checkpoint", lambda _: stored)
    model = load_model(F32)
    assert prefill_then_greedy(model, PROMPT, 48)[1] != prefill_then_greedy(fp32, PROMPT, 48)[1]


def test_q8_0_weights_are_the_gguf_packages_dequantization():
    reader = gguf.GGUFReader(str(Q8_0))
    stored = read_gguf(Q8_0)
    permute = make_gguf.permute
    config = ModelConfig.from_pretrained(Q8_0)
    types = set()
    for tensor in reader.tensors:
        types.add(T(tensor.tensor_type))
        want = dequantize(tensor.data, tensor.tensor_type)
        got = stored[hf_name(tensor.name, Q8_0)]
        # the Q8_0 matrices (the linear weights and the embedding table) stay Q8_0, the rest as stored
        kept = isinstance(got, IntGroups)
        assert kept == (T(tensor.tensor_type) == T.Q8_0), tensor.name
        if not kept:
            assert got.dtype == {T.F16: np.float16, T.F32: np.float32}[T(tensor.tensor_type)], tensor.name
        got = got.dequantize() if kept else got.astype(np.float32)
        if tensor.name.endswith("attn_q.weight"):
            got = permute(got, config.num_attention_heads)
        elif tensor.name.endswith("attn_k.weight"):
            got = permute(got, config.num_key_value_heads)
        assert got.dtype == np.float32 and np.array_equal(got, want), tensor.name
    assert types == {T.Q8_0, T.F16, T.F32}  # ffn_down's 172 columns are no whole Q8_0 block: F16


def test_q8_0_top1_agreement_with_fp32(fp32, story_ids):
    quantized = load_model(Q8_0)
    want, _ = prefill_then_greedy(fp32, story_ids, 1)
    got, _ = prefill_then_greedy(quantized, story_ids, 1)
    agreement = float((got.argmax(-1) == want.argmax(-1)).mean())
    print(f"Q8_0 top-1 agreement over {len(story_ids)} positions: {agreement:.4f}")
    assert agreement >= Q8_0_MIN_AGREEMENT
    assert not np.array_equal(got, want)  # the file's weights are the quantized ones


@pytest.mark.parametrize("path", [F32, Q8_0], ids=lambda p: p.name)
def test_rebuilt_tokenizer_equals_tokenizer_json(path):
    want, got = Tokenizer.from_pretrained(SAFETENSORS), Tokenizer.from_pretrained(path)
    assert (got.bos_token_id, got.eos_token_ids, got.vocab_size) == (
        want.bos_token_id,
        want.eos_token_ids,
        want.vocab_size,
    )
    for text in TEXTS:
        ids = want.encode(text)
        assert got.encode(text) == ids, text
        assert got.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False)
        assert got.decode(ids) == want.decode(ids) and got.decode(ids, False) == want.decode(ids, False)
    every = list(range(want.vocab_size))
    assert got.decode(every, False) == want.decode(every, False)


def test_a_gguf_file_is_a_model_for_the_cli_and_llm(capsys):
    outputs = []
    for model in (SAFETENSORS, F32):
        assert main(["generate", str(model), "Once upon a time", "--max-tokens", "24"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0]) > len("Once upon a time\n")
    params = SamplingParams(temperature=0.0, max_tokens=24)
    out = LLM(str(Q8_0)).generate(["Tom had a red"], params)[0].outputs[0]
    assert out.text.startswith(" ball.") and len(out.token_ids) == 24


def rewrite(tmp_path, change_meta=None, change_tensors=None, alignment=None) -> Path:
    """The F32 file with metadata fields and tensors changed: (key, value, type) and (name, array, type),
    and its data aligned to `alignment` bytes (general.alignment) instead of the default 32."""
    reader = gguf.GGUFReader(str(F32))
    fields = [f for f in reader.fields.values() if not f.name.startswith("GGUF.")]
    meta = {f.name: (f.contents(), f.types) for f in fields}
    meta.update(change_meta or {})
    out = tmp_path / "changed.gguf"
    writer = gguf.GGUFWriter(str(out), meta.pop("general.architecture")[0])
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for name, (value, types) in meta.items():
        if types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, types[0])
    for tensor in reader.tensors:
        data, kind = np.asarray(tensor.data), T(tensor.tensor_type)
        data, kind = (change_tensors or {}).get(tensor.name, (data, kind))
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_the_files_alignment_places_the_tensors_and_a_cut_or_bad_file_is_named(tmp_path):
    want = read_gguf(F32)
    path = rewrite(tmp_path, alignment=256)
    got = read_gguf(path)
    assert set(got) == set(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="tensor 'output_norm.weight': the file ends inside its data"):
        read_gguf(cut)
    twice = tmp_path / "twice.gguf"
    twice.write_bytes(path.read_bytes().replace(b"blk.0.attn_k.weight", b"blk.0.attn_q.weight", 1))
    with pytest.raises(
        ValueError, match="twice.gguf: not a readable GGUF file .two tensors are named 'blk.0"
    ):
        read_gguf(twice)


def test_unsupported_architecture_is_named(tmp_path):
    path = rewrite(tmp_path, {"general.architecture": ("gemma2", [gguf.GGUFValueType.STRING])})
    with pytest.raises(UnsupportedGGUF, match="architecture 'gemma2'"):
        ModelConfig.from_pretrained(path)


def test_unsupported_tokenizer_model_is_named(tmp_path):
    path = rewrite(tmp_path, {"tokenizer.ggml.model": ("t5", [gguf.GGUFValueType.STRING])})
    with pytest.raises(UnsupportedGGUF, match="tokenizer model 't5'"):
        Tokenizer.from_pretrained(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    q4_1 = np.zeros((172, 64 // 32 * 20), np.uint8)  # 20-byte blocks of 32 weights
    path = rewrite(tmp_path, change_tensors={"blk.1.ffn_up.weight": (q4_1, T.Q4_1)})
    with pytest.raises(UnsupportedTensorType, match="'blk.1.ffn_up.weight' has GGUF type Q4_1"):
        load_model(path)


def test_fused_tensors_mixing_float_and_quantized_are_all_widened():
    from minisarathi.quant.gguf_file import widen_mixed_fusions
    from minisarathi.quant.kquants import quantize as k_quantize
    from minisarathi.quant.layouts import from_gguf

    rng = np.random.default_rng(3)
    weights = rng.standard_normal((4, 256)).astype(np.float32)
    q4_k, q6_k = (from_gguf("w", int(T[t]), k_quantize(weights, t)) for t in ("Q4_K", "Q6_K"))
    prefix = "model.layers.0."
    tensors = {
        prefix + "self_attn.q_proj.weight": q4_k,
        prefix + "self_attn.k_proj.weight": q4_k,
        prefix + "self_attn.v_proj.weight": q6_k,  # quantized parts of different layouts stay quantized
        prefix + "mlp.gate_proj.weight": q4_k,
        prefix + "mlp.up_proj.weight": weights,  # a float part widens the quantized ones beside it
        "model.layers.1.mlp.gate_proj.weight": weights.astype(np.float16),  # float16 beside float32
        "model.layers.1.mlp.up_proj.weight": weights,
        "model.layers.1.self_attn.q_proj.weight": weights.astype(np.float16),  # one dtype: kept
        "model.layers.1.self_attn.k_proj.weight": weights.astype(np.float16),
    }
    widen_mixed_fusions(tensors)
    forms = {n: "quantized" if hasattr(t, "dequantize") else t.dtype.name for n, t in tensors.items()}
    assert [forms[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"] == ["quantized"] * 3
    assert forms[prefix + "mlp.gate_proj.weight"] == forms[prefix + "mlp.up_proj.weight"] == "float32"
    assert np.array_equal(tensors[prefix + "mlp.gate_proj.weight"], q4_k.dequantize())
    assert forms["model.layers.1.mlp.gate_proj.weight"] == "float32"
    assert forms["model.layers.1.self_attn.q_proj.weight"] == "float16"


@pytest.mark.parametrize("kind", [T.F16, T.BF16], ids=lambda t: t.name)
def test_a_16_bit_file_keeps_its_matrices_in_16_bits_as_views_of_the_file(tmp_path, fp32, kind):
    file_type = {T.F16: gguf.LlamaFileType.MOSTLY_F16, T.BF16: gguf.LlamaFileType.MOSTLY_BF16}[kind]
    path = make_gguf.write_gguf(SAFETENSORS, tmp_path / "16.gguf", kind, file_type=file_type)
    config = ModelConfig.from_pretrained(SAFETENSORS)
    want, got = load_weights(SAFETENSORS, config), load_weights(path, config)
    dtype = {T.F16: "float16", T.BF16: "bfloat16"}[kind]
    for name in ("embed_tokens", "layers.0.o_proj", "layers.4.down_proj"):
        assert got[name].dtype == dtype and not got[name].data.flags.owndata, name
        rounded = to_float32(convert(np.asarray(want[name]), "float32", dtype), dtype)
        assert np.array_equal(np.asarray(got[name]), rounded), name
    assert got["norm"].dtype == "float32"
    model = load_model(path)
    assert prefill_then_greedy(model, PROMPT, 24)[1] == prefill_then_greedy(fp32, PROMPT, 24)[1]
