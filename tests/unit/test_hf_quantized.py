"""AWQ, GPTQ and FP8 folders (minisarathi/quant/hf_quantized.py): each conversion bit for bit against a plain
unpacker written from the formats' descriptions (bit by bit, not the module's vectorised code), each folder's
model against a float64 forward over those weights, every refused variant named, and negative controls."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from minisarathi.config import ModelConfig
from minisarathi.model.families import load_model
from minisarathi.model.loader import load_weights, read_checkpoint
from minisarathi.quant import hf_quantized
from minisarathi.quant.layouts import E4M3, Fp8Rows, IntGroups, UintGroups, concatenate_rows
from minisarathi.testing import float64_logits, prefill_then_greedy, relative_error

ROOT = Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location(
    "make_quantized_folders", ROOT / "tests" / "golden" / "make_quantized_folders.py"
)
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)

PROMPT = [1, 403, 407, 100, 200, 31]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


# The reference unpackers: one bit at a time, as the formats describe their words
# ------------------------------------------------------------------------------


def field(words: np.ndarray, first_bit: int, bits: int) -> np.ndarray:
    """int64 of bits first_bit .. first_bit + bits - 1 of every int32 word, gathered bit by bit."""
    value = np.zeros(words.shape, np.int64)
    unsigned = words.astype(np.int64) & 0xFFFFFFFF
    for b in range(bits):
        value |= ((unsigned >> (first_bit + b)) & 1) << b
    return value


def reference_awq(qweight, qzeros, scales) -> np.ndarray:
    """float64[out, in]: AutoAWQ GEMM, whose word c of row k holds output 8c + AWQ_ORDER[i] in bits 4i..4i+3
    (the [in, out] matrix packed along out), and w = (q - zero) * scale per group of in."""
    K, words = qweight.shape
    group = K // scales.shape[0]
    w = np.zeros((words * 8, K))
    for c in range(words):
        for i, column in enumerate(make.AWQ_ORDER):
            n = 8 * c + column
            q = field(qweight[:, c], 4 * i, 4)  # [K]
            zero = np.repeat(field(qzeros[:, c], 4 * i, 4), group)  # [K]
            w[n] = (q - zero) * np.repeat(scales[:, n].astype(np.float64), group)
    return w


def reference_gptq(qweight, qzeros, scales, bits, zero_offset=1) -> np.ndarray:
    """float64[out, in]: AutoGPTQ, whose row r of qweight holds input r * 32 / bits + j in bits
    bits * j.., whose qzeros pack outputs the same way, stored as zero - 1 (v1)."""
    per = 32 // bits
    K, N = qweight.shape[0] * per, qweight.shape[1]
    group = K // scales.shape[0]
    zeros = np.zeros((scales.shape[0], N), np.int64)
    for n in range(N):
        zeros[:, n] = field(qzeros[:, n // per], bits * (n % per), bits) + zero_offset
    w = np.zeros((N, K))
    for k in range(K):
        q = field(qweight[k // per], bits * (k % per), bits)  # [N]
        w[:, k] = (q - zeros[k // group]) * scales[k // group].astype(np.float64)
    return w


def e4m3(byte: int) -> float:
    """The OCP E4M3FN value of one byte: sign, exponent (bias 7), mantissa; exponent 0 subnormal;
    S.1111.111 NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 15 and mantissa == 7:
        return math.nan
    if exponent == 0:
        return sign * math.ldexp(mantissa, -9)
    return sign * math.ldexp(8 + mantissa, exponent - 10)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def reference_fp8(weight, scale) -> np.ndarray:
    """float32[out, in]: the E4M3 byte's value times its scale (one per tensor or per row), in float32."""
    values = np.array([e4m3(byte) for byte in range(256)], np.float32)[weight]  # float32[out, in]
    return values * np.asarray(scale, np.float32).reshape(-1, 1)


def reference_weight(fmt: str, parts: dict) -> np.ndarray:
    """float32[out, in] of one linear's parts (name -> (safetensors dtype, array)), as the script wrote."""
    arrays = {name: array for name, (_, array) in parts.items()}
    if fmt == "awq":
        w = reference_awq(arrays["qweight"], arrays["qzeros"], arrays["scales"])
    elif fmt.startswith("gptq"):
        w = reference_gptq(arrays["qweight"], arrays["qzeros"], arrays["scales"], 8 if "8" in fmt else 4)
    else:
        dtype, scale = parts["weight_scale"]
        return reference_fp8(arrays["weight"], bf16_values(scale) if dtype == "BF16" else scale)
    w32 = w.astype(np.float32)
    assert np.array_equal(w32, w)  # every such weight is a float32: the comparison below is exact
    return w32


def linear_parts(fmt: str, seed: int, shape=(256, 384)) -> dict:
    return make.linear_tensors(fmt, np.random.default_rng(seed), *shape)


class Stored:
    """A loader CheckpointTensor's stand-in: dtype name and data."""

    def __init__(self, dtype: str, data: np.ndarray):
        self.dtype, self.data = dtype, data


def as_checkpoint(parts: dict, prefix: str = "model.layers.0.mlp.up_proj.") -> dict:
    names = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "I32": "int32", "F8_E4M3": "float8_e4m3"}
    return {prefix + n: Stored(names[d], a) for n, (d, a) in parts.items()}


def convert(fmt: str, parts: dict, tmp_path: Path, config: dict | None = None):
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": config or make.quantization_config(fmt)})
    )
    layouts = hf_quantized.quantized_linears(tmp_path, as_checkpoint(parts))
    assert list(layouts) == ["model.layers.0.mlp.up_proj.weight"]
    return layouts["model.layers.0.mlp.up_proj.weight"]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# Each conversion, bit for bit
# ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", make.FORMATS)
@pytest.mark.parametrize("seed", [1, 2])
def test_each_conversion_is_the_reference_unpacking_bit_for_bit(fmt, seed, tmp_path):
    parts = linear_parts(fmt, seed)
    layout = convert(fmt, parts, tmp_path)
    kind = {"awq": UintGroups, "gptq4": UintGroups, "gptq8": IntGroups, "fp8": Fp8Rows}[fmt.split("-")[0]]
    assert type(layout) is kind and layout.shape == (256, 384)
    assert same_bits(layout.dequantize(), reference_weight(fmt, parts))


def test_the_layouts_fields_are_the_stored_numbers(tmp_path):
    # AWQ: the codes as packed, one scale per 32 repeated from each group of 128, minimum = scale * zero
    parts = linear_parts("awq", 3)
    layout = convert("awq", parts, tmp_path)
    qweight, qzeros, scales = (parts[n][1] for n in ("qweight", "qzeros", "scales"))
    for n in (0, 5, 255):
        word, nibble = n // 8, make.AWQ_ORDER.index(n % 8)
        assert np.array_equal(layout.codes()[n], field(qweight[:, word], 4 * nibble, 4))
        zero = field(qzeros[:, word], 4 * nibble, 4)
        assert np.array_equal(layout.scale[n], np.repeat(scales[:, n].astype(np.float32), 4))
        assert np.array_equal(layout.minimum[n], np.repeat(scales[:, n].astype(np.float32) * zero, 4))
    # GPTQ 8-bit: int8 q - 128, the fp16 scales kept fp16 (Q8_0's form)
    parts = linear_parts("gptq8-sym", 3)
    layout = convert("gptq8-sym", parts, tmp_path)
    assert layout.group == 32 and layout.scale.dtype == np.float16 and layout.bits == 8
    word = parts["qweight"][1][0, 7]  # inputs 0..3 of output 7, a byte each
    assert layout.values[7, :4].tolist() == [int(field(word, 8 * j, 8)) - 128 for j in range(4)]


def test_gptq_v2_zero_points_are_stored_as_they_are(tmp_path):
    parts = linear_parts("gptq4-asym", 4)
    config = make.quantization_config("gptq4-asym") | {"checkpoint_format": "gptq_v2"}
    layout = convert("gptq4-asym", parts, tmp_path, config)
    arrays = {n: a for n, (_, a) in parts.items()}
    want = reference_gptq(arrays["qweight"], arrays["qzeros"], arrays["scales"], 4, zero_offset=0)
    assert same_bits(layout.dequantize(), want.astype(np.float32))


def test_bf16_scales_are_exact_too(tmp_path):
    parts = linear_parts("gptq4-asym", 5)
    scales = parts["scales"][1].astype(np.float32)
    parts["scales"] = make.bf16((scales.view(np.uint32) & 0xFFFF0000).view(np.float32))
    layout = convert("gptq4-asym", parts, tmp_path)
    arrays = {n: a for n, (_, a) in parts.items()}
    want = reference_gptq(arrays["qweight"], arrays["qzeros"], bf16_values(arrays["scales"]), 4)
    assert same_bits(layout.dequantize(), want.astype(np.float32))


def test_e4m3_table_is_every_bytes_value():
    want = np.array([e4m3(b) for b in range(256)], np.float32)
    assert np.array_equal(E4M3, want, equal_nan=True)
    assert E4M3[0x7E] == 448 and E4M3[0x01] == 2.0**-9 and np.isnan(E4M3[0xFF]) and E4M3[0x80] == 0


def test_fp8_fusion_stacks_rows_and_takes_the_largest_input_scale(tmp_path):
    layouts = [
        convert("fp8-tensor", linear_parts("fp8-tensor", s, (64 * (s + 1), 128)), tmp_path) for s in range(3)
    ]
    fused = concatenate_rows(layouts)
    assert type(fused) is Fp8Rows and fused.shape == (384, 128)
    assert fused.input_scale == max(p.input_scale for p in layouts)
    assert same_bits(fused.dequantize(), np.concatenate([p.dequantize() for p in layouts]))


# Negative controls: the comparisons catch a wrong packing
# ------------------------------------------------------------------------------


def test_a_wrong_pack_order_is_caught(tmp_path, monkeypatch):
    parts = linear_parts("awq", 6)
    want = reference_weight("awq", parts)
    # AWQ words read in plain order, or GPTQ v1's zeros without their + 1
    monkeypatch.setattr(hf_quantized, "AWQ_NIBBLE", tuple(range(8)))
    assert not np.array_equal(convert("awq", parts, tmp_path).dequantize(), want)
    monkeypatch.undo()
    assert np.array_equal(convert("awq", parts, tmp_path).dequantize(), want)
    gptq = linear_parts("gptq4-asym", 6)
    config = make.quantization_config("gptq4-asym") | {"checkpoint_format": "gptq_v2"}
    assert not np.array_equal(
        convert("gptq4-asym", gptq, tmp_path, config).dequantize(), reference_weight("gptq4-asym", gptq)
    )
    # the script's packing in sequential order where AutoAWQ's is interleaved: a folder packed so is wrong
    sequential = dict(parts, qweight=make.plain(make.pack_sequential(field_codes(parts), 4, axis=1)))
    assert not np.array_equal(convert("awq", sequential, tmp_path).dequantize(), want)


def field_codes(awq_parts: dict) -> np.ndarray:
    """The [in, out] codes of AWQ parts, unpacked by the reference's order."""
    qweight = awq_parts["qweight"][1]
    codes = np.zeros((qweight.shape[0], qweight.shape[1] * 8), np.int64)
    for c in range(qweight.shape[1]):
        for i, column in enumerate(make.AWQ_ORDER):
            codes[:, 8 * c + column] = field(qweight[:, c], 4 * i, 4)
    return codes


def test_flipping_one_code_bit_changes_exactly_one_weight(tmp_path):
    for fmt in ("awq", "gptq4-sym", "gptq8-sym"):
        parts = linear_parts(fmt, 7)
        before = convert(fmt, parts, tmp_path).dequantize()
        qweight = parts["qweight"][1].copy()
        qweight.view(np.uint32)[3, 5] ^= np.uint32(1 << 9)
        after = convert(fmt, dict(parts, qweight=make.plain(qweight)), tmp_path).dequantize()
        assert (after != before).sum() == 1, fmt


# Whole folders as models
# ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=make.FORMATS)
def folder(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make.write_folder(tmp_path_factory.mktemp(request.param), request.param)


def test_folder_loads_its_linears_quantized_and_the_rest_16_bit(folder):
    fmt, path = folder
    config = ModelConfig.from_pretrained(path)
    weights = load_weights(path, config)
    for name in ("layers.0.qkv_proj", "layers.1.gate_up_proj", "layers.1.o_proj", "layers.0.down_proj"):
        assert weights[name].dtype == "quantized", name
    assert weights["lm_head"].dtype == weights["embed_tokens"].dtype == weights["norm"].dtype
    assert weights["lm_head"].dtype == ("bfloat16" if fmt.startswith("fp8") else "float16")
    # every stored linear is its reference unpacking, fused in q, k, v and gate, up order
    raw = raw_parts(path)
    for i in range(config.num_hidden_layers):
        for fused, names in (
            ("qkv_proj", LINEARS[:3]),
            ("o_proj", ("o_proj",)),
            ("gate_up_proj", LINEARS[4:6]),
            ("down_proj", ("down_proj",)),
        ):
            want = np.concatenate(
                [reference_weight(fmt, raw[f"model.layers.{i}.{MODULE.get(n, 'mlp')}.{n}."]) for n in names]
            )
            assert same_bits(np.asarray(weights[f"layers.{i}.{fused}"]), want), (i, fused)


def raw_parts(path: Path) -> dict:
    """prefix -> {part: (safetensors dtype, array)} of the folder's file, read without the loader."""
    data = (path / "model.safetensors").read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    numpy = {"F16": np.float16, "BF16": np.uint16, "F32": np.float32, "I32": np.int32, "F8_E4M3": np.uint8}
    parts: dict = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        array = np.frombuffer(data[8 + length + begin : 8 + length + end], numpy[info["dtype"]])
        prefix, part = name.rsplit(".", 1)
        parts.setdefault(prefix + ".", {})[part] = (info["dtype"], array.reshape(info["shape"]))
    return parts


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_folder_model_is_the_float64_forward_over_its_weights(folder, device):
    fmt, path = folder
    if device == "cpu" and not fmt.startswith("fp8"):
        pytest.skip("kept compact on the CPU, int8 activations: tests/unit/test_quant_linear_models.py")
    model = load_model(path, device=device)
    config = ModelConfig.from_pretrained(path)
    logits, tokens = prefill_then_greedy(model, PROMPT, 12)
    want = float64_logits(config, load_weights(path, config), PROMPT + tokens[:-1])  # float64[T, V]
    assert relative_error(logits, want[: len(PROMPT)]) <= 1e-5
    # each greedy token is float64's best, or within float32's reach of it
    chosen = want[len(PROMPT) - 1 :][np.arange(len(tokens)), tokens]
    assert np.all(chosen >= want[len(PROMPT) - 1 :].max(axis=1) - 1e-5 * np.abs(want).max())


def test_the_fp8_method_reads_as_compressed_tensors(tmp_path):
    """AutoFP8's quant_method fp8 (static activations) over the same tensors gives the same layouts."""
    path = make.write_folder(tmp_path / "ct", "fp8-tensor")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    other = make.write_folder(tmp_path / "fp8", "fp8-tensor")
    (other / "config.json").write_text(json.dumps(config))
    want, got = read_checkpoint(path), read_checkpoint(other)
    quantized = [name for name in want if want[name].dtype == "quantized"]
    assert len(quantized) == 14
    for name in quantized:
        assert same_bits(got[name].data.dequantize(), want[name].data.dequantize())
        assert got[name].data.input_scale == want[name].data.input_scale is not None


def test_a_wrongly_packed_folder_gives_other_logits(tmp_path, monkeypatch):
    """The model-level negative control: AWQ's words read in plain order change the forward."""
    path = make.write_folder(tmp_path / "awq", "awq")
    config = ModelConfig.from_pretrained(path)
    want = float64_logits(config, load_weights(path, config), PROMPT)
    assert (
        relative_error(prefill_then_greedy(load_model(path, device="reference"), PROMPT, 1)[0], want) < 1e-5
    )
    monkeypatch.setattr(hf_quantized, "AWQ_NIBBLE", tuple(range(8)))
    assert (
        relative_error(prefill_then_greedy(load_model(path, device="reference"), PROMPT, 1)[0], want) > 1e-2
    )


# Refused variants, named
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, words",
    [
        ({"quant_method": "bitsandbytes"}, ["quant_method", "bitsandbytes"]),
        (make.quantization_config("awq") | {"version": "gemv"}, ["awq", "version", "gemv"]),
        (make.quantization_config("awq") | {"version": "marlin"}, ["awq", "version", "marlin"]),
        (make.quantization_config("awq") | {"zero_point": False}, ["awq", "zero_point", "False"]),
        (make.quantization_config("awq") | {"bits": 3}, ["awq", "bits", "3"]),
        (make.quantization_config("awq") | {"group_size": 100}, ["awq", "group_size", "100"]),
        (make.quantization_config("gptq4-sym") | {"bits": 2}, ["gptq", "bits", "2"]),
        (make.quantization_config("gptq8-sym") | {"sym": False}, ["gptq", "sym", "False"]),
        (make.quantization_config("gptq4-sym") | {"group_size": 48}, ["gptq", "group_size", "48"]),
        (
            make.quantization_config("gptq4-sym") | {"checkpoint_format": "marlin"},
            ["checkpoint_format", "marlin"],
        ),
        (make.quantization_config("gptq4-sym") | {"is_marlin_format": True}, ["is_marlin_format", "True"]),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            ["weight_block_size"],
        ),
        ({"quant_method": "fp8", "activation_scheme": "sometimes"}, ["activation_scheme", "sometimes"]),
        (make.quantization_config("fp8-tensor") | {"format": "pack-quantized"}, ["format", "pack-quantized"]),
        (make.quantization_config("fp8-tensor") | {"kv_cache_scheme": {"num_bits": 8}}, ["kv_cache_scheme"]),
    ],
)
def test_unsupported_configs_are_named(config, words):
    with pytest.raises(ValueError) as error:
        hf_quantized.read_scheme(config)
    for word in words:
        assert word in str(error.value)
    # and config.json refuses them too, before any tensor is read
    folder = json.loads((ROOT / "models" / "stories260K" / "config.json").read_text())
    with pytest.raises(ValueError, match="quantization_config"):
        ModelConfig.from_dict(folder | {"quantization_config": config})


def test_compressed_tensors_refuses_other_strategies():
    base = make.quantization_config("fp8-tensor")
    for weights, inputs, word in (
        ({"strategy": "block"}, None, "weights"),
        ({"strategy": "group", "group_size": 128}, None, "weights"),
        ({"type": "int"}, None, "weights"),
        ({}, {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}, "input_activations"),
    ):
        group = json.loads(json.dumps(base["config_groups"]["group_0"]))
        group["weights"] |= weights
        if inputs is not None:
            group["input_activations"] = inputs
        with pytest.raises(ValueError, match=word):
            hf_quantized.read_scheme(base | {"config_groups": {"group_0": group}})


def test_tensor_variants_are_named(tmp_path):
    # desc_act with a real permutation
    parts = linear_parts("gptq4-sym", 8)
    perm = make.plain(np.random.default_rng(0).permutation(np.arange(384) // 128).astype(np.int32))
    with pytest.raises(ValueError, match=r"up_proj\.qweight.*g_idx.*desc_act"):
        convert(
            "gptq4-sym",
            dict(parts, g_idx=perm),
            tmp_path,
            make.quantization_config("gptq4-sym") | {"desc_act": True},
        )
    # 8-bit zero points other than 128
    parts = linear_parts("gptq8-sym", 8)
    qzeros = parts["qzeros"][1].copy()
    qzeros.view(np.uint32)[0, 0] ^= np.uint32(1)
    with pytest.raises(ValueError, match=r"up_proj\.qweight.*zero point is not 128"):
        convert("gptq8-sym", dict(parts, qzeros=make.plain(qzeros)), tmp_path)
    # groups that the config does not name, and shapes that do not fit
    with pytest.raises(ValueError, match=r"up_proj\.qweight.*groups of 128.*group_size is 64"):
        convert("awq", linear_parts("awq", 8), tmp_path, make.quantization_config("awq") | {"group_size": 64})
    parts = linear_parts("awq", 8)
    with pytest.raises(ValueError, match=r"up_proj\.qzeros.*shape \[3, 31\]"):
        convert("awq", dict(parts, qzeros=make.plain(parts["qzeros"][1][:, :31].copy())), tmp_path)
    # a missing part, scales of another dtype, a non-finite scale
    with pytest.raises(ValueError, match=r"up_proj\.qzeros.*missing"):
        convert("awq", {k: v for k, v in parts.items() if k != "qzeros"}, tmp_path)
    with pytest.raises(ValueError, match=r"up_proj\.scales.*float32"):
        convert("awq", dict(parts, scales=make.plain(parts["scales"][1].astype(np.float32))), tmp_path)
    scales = parts["scales"][1].copy()
    scales[1, 2] = np.inf
    with pytest.raises(ValueError, match=r"up_proj\.qweight.*not finite"):
        convert("awq", dict(parts, scales=make.plain(scales)), tmp_path)
    # FP8: scales per group, a missing static input scale
    parts = linear_parts("fp8-tensor", 8)
    with pytest.raises(
        ValueError, match=r"up_proj\.weight_scale.*\[256, 3\].*per tensor or per output channel"
    ):
        convert("fp8-tensor", dict(parts, weight_scale=make.plain(np.ones((256, 3), np.float32))), tmp_path)
    with pytest.raises(ValueError, match=r"up_proj\.input_scale.*missing"):
        convert("fp8-tensor", {k: v for k, v in parts.items() if k != "input_scale"}, tmp_path)


def test_packed_tensors_need_their_config(tmp_path):
    parts = as_checkpoint(linear_parts("awq", 9))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"up_proj\.qweight.*int32.*quantization_config"):
        hf_quantized.quantized_linears(tmp_path, parts)
    # and in a folder of one format, another's packed tensor is named
    fp8 = as_checkpoint(linear_parts("fp8-tensor", 9), "model.layers.1.mlp.up_proj.")
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": make.quantization_config("awq")})
    )
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight.*float8_e4m3.*not part of a awq"):
        hf_quantized.quantized_linears(tmp_path, parts | fp8)


def test_a_packed_folder_without_its_config_is_refused_at_load(tmp_path):
    path = make.write_folder(tmp_path / "gptq", "gptq4-sym")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"tensor 'model\.layers\.0\..*' has dtype int32.*quantization_config"
    ):
        load_weights(path, ModelConfig.from_pretrained(path))
