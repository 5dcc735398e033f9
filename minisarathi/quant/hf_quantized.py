"""Hugging Face folders with a `quantization_config`: AWQ (GEMM), GPTQ and FP8 E4M3 linear weights onto the
layouts of quant/layouts.py, as published and without loss (docs/quantization.md, "Hugging Face quantized
folders"). Anything else is refused, naming the tensor or the setting and its value."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minisarathi.dtypes import to_float32
from minisarathi.quant.layouts import UINT_GROUP, Fp8Rows, IntGroups, UintGroups

# the stored dtypes (loader.STORED_DTYPES' names) that only a quantized linear's parts may have
PACKED_DTYPES = ("int32", "float8_e4m3")
SCALE_DTYPES = ("float16", "bfloat16")  # AWQ/GPTQ scales: exact in float32, and times a zero point too
FLOAT_DTYPES = ("float32", *SCALE_DTYPES)  # FP8 scales
# AutoAWQ's GEMM packing puts columns 0, 2, 4, 6, 1, 3, 5, 7 of each 8 into a word's nibbles 0..7, so
# column j is nibble AWQ_NIBBLE[j]
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class Scheme:
    """What a quantization_config asks of its linear weights."""

    method: str  # "awq", "gptq" or "fp8" (compressed-tensors' float-quantized too)
    bits: int
    group: int  # weights per scale along the input; -1: the whole row
    zero_offset: int  # added to a stored zero point: GPTQ v1 stores zero - 1
    static_inputs: bool  # FP8: whether every linear has an input_scale


def read_scheme(config: object) -> Scheme:
    """The Scheme of a config.json's quantization_config, or ValueError naming what is not supported."""
    if not isinstance(config, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {config!r}")
    method = config.get("quant_method")

    def need(key: str, allowed: tuple, default=None) -> object:
        value = config.get(key, default)
        if value not in allowed:
            raise ValueError(
                f"quantization_config ({method}): {key} {value!r} is not supported (supported: "
                f"{', '.join(map(repr, allowed))})"
            )
        return value

    if method == "awq":
        need("version", ("gemm", "GEMM"))
        need("zero_point", (True,))
        return Scheme("awq", need("bits", (4,)), _group(config, method), 0, False)
    if method == "gptq":
        offset = {"gptq": 1, "gptq_v2": 0}[need("checkpoint_format", ("gptq", "gptq_v2"), "gptq")]
        need("is_marlin_format", (False,), False)
        bits = need("bits", (4, 8))
        if bits == 8:
            # int8 holds q - 128 only: an 8-bit zero point other than 128 would need 9 bits
            need("sym", (True,))
        return Scheme("gptq", bits, _group(config, method), offset, False)
    if method == "fp8":
        need("weight_block_size", (None,))
        static = need("activation_scheme", ("static", "dynamic")) == "static"
        return Scheme("fp8", 8, -1, 0, static)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    raise ValueError(
        f"quantization_config: quant_method {method!r} is not supported (supported: 'awq', 'gptq', "
        f"'fp8', 'compressed-tensors')"
    )


def _group(config: dict, method: str) -> int:
    group = config.get("group_size")
    if type(group) is not int or not (group == -1 or (group > 0 and group % UINT_GROUP == 0)):
        raise ValueError(
            f"quantization_config ({method}): group_size {group!r} is not supported (a multiple of "
            f"{UINT_GROUP}, or -1)"
        )
    return group


def _compressed_tensors(config: dict) -> Scheme:
    """compressed-tensors' FP8 E4M3: weights per tensor or per channel, activations static per tensor or
    dynamic, in every config group."""
    where = "quantization_config (compressed-tensors)"
    if config.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"{where}: format {config.get('format')!r} is not supported (float-quantized)")
    if config.get("kv_cache_scheme") is not None:
        raise ValueError(f"{where}: kv_cache_scheme is not supported (the KV cache stays float)")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}: config_groups must be a non-empty object")
    statics = set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        inputs = group.get("input_activations") if isinstance(group, dict) else None
        if not isinstance(weights, dict) or (
            weights.get("num_bits"),
            weights.get("type"),
            weights.get("strategy"),
            weights.get("dynamic", False),
        ) not in ((8, "float", "tensor", False), (8, "float", "channel", False)):
            raise ValueError(
                f"{where}: config group {name!r} has weights {weights!r}; supported: 8-bit float, static, "
                f"strategy tensor or channel"
            )
        if inputs is not None and (
            not isinstance(inputs, dict)
            or (inputs.get("num_bits"), inputs.get("type")) != (8, "float")
            or (inputs.get("dynamic", False), inputs.get("strategy"))
            not in ((False, "tensor"), (True, "token"))
        ):
            raise ValueError(
                f"{where}: config group {name!r} has input_activations {inputs!r}; supported: none, 8-bit "
                f"float static per tensor, or dynamic per token"
            )
        statics.add(inputs is not None and not inputs.get("dynamic", False))
    if len(statics) > 1:
        raise ValueError(f"{where}: config groups mix static and dynamic input_activations")
    return Scheme("fp8", 8, -1, 0, statics.pop())


def quantized_linears(model_dir: str | Path, tensors: Mapping) -> dict[str, UintGroups | IntGroups | Fp8Rows]:
    """`prefix.weight` -> its layout, for every quantized linear among a folder's tensors (loader
    CheckpointTensors), as the folder's config.json quantization_config describes them. Every tensor of a
    packed dtype must be part of one."""
    config_file = Path(model_dir) / "config.json"  # ModelConfig has checked it, read_scheme included
    config = json.loads(config_file.read_text()).get("quantization_config") if config_file.is_file() else None
    packed = {n for n, t in tensors.items() if t.dtype in PACKED_DTYPES}
    if config is None:
        if packed:
            name = min(packed)
            raise ValueError(
                f"tensor {name!r} has dtype {tensors[name].dtype}, which needs a quantization_config in "
                f"config.json"
            )
        return {}
    scheme = read_scheme(config)
    layouts, used = {}, set()
    if scheme.method == "fp8":
        for name in sorted(n for n in packed if tensors[n].dtype == "float8_e4m3"):
            prefix = name.removesuffix("weight")
            scale = _part(tensors, prefix + "weight_scale", name, FLOAT_DTYPES)
            given = (
                _part(tensors, prefix + "input_scale", name, FLOAT_DTYPES) if scheme.static_inputs else None
            )
            layouts[name] = fp8_layout(name, tensors[name].data, scale, given)
            used.add(name)
    for name in sorted(n for n in tensors if n.endswith(".qweight") and scheme.method != "fp8"):
        prefix = name.removesuffix("qweight")
        qweight, qzeros = (
            _part(tensors, prefix + p, name, ("int32",)).view(np.uint32) for p in ("qweight", "qzeros")
        )
        scales = _part(tensors, prefix + "scales", name, SCALE_DTYPES)  # float32[K / g, N]
        if scheme.method == "awq":
            layout = awq_layout(name, qweight, qzeros, scales, scheme)
        else:
            g_idx = tensors.get(prefix + "g_idx")
            g_idx = None if g_idx is None else np.asarray(g_idx.data)
            fp16 = tensors[prefix + "scales"].dtype == "float16"
            layout = gptq_layout(name, qweight, qzeros, scales, g_idx, scheme, fp16)
        layouts[prefix + "weight"] = layout
        used.update(prefix + p for p in ("qweight", "qzeros", "g_idx"))
    stray = sorted(packed - used)
    if stray:
        raise ValueError(
            f"tensor {stray[0]!r} ({tensors[stray[0]].dtype}) is not part of a {scheme.method} linear weight"
        )
    return layouts


def _part(tensors: Mapping, name: str, of: str, dtypes: tuple[str, ...]) -> np.ndarray:
    """Tensor `name`, a part of linear `of`: int32 as stored, a float as float32 (exact)."""
    if name not in tensors:
        raise ValueError(f"tensor {name!r} is missing (a part of {of!r})")
    tensor = tensors[name]
    if tensor.dtype not in dtypes:
        raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; supported: {', '.join(dtypes)}")
    return tensor.data if tensor.dtype == "int32" else to_float32(tensor.data, tensor.dtype)


def unpack(words: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """uint8 values of uint32 words [R, C], each word's 32 // bits fields unpacked along `axis`: field j
    (order[j]: its place in the word, bit bits * order[j] up; order 0, 1, 2, ... by default) of word
    [r, c] lands at [r * 32 // bits + j, c] (axis 0) or [r, c * 32 // bits + j] (axis 1)."""
    per = 32 // bits
    R, C = words.shape
    out = np.empty((R, per, C) if axis == 0 else (R, C, per), np.uint8)
    mask = np.uint32((1 << bits) - 1)
    for j, place in enumerate(order or range(per)):
        out[(slice(None), j) if axis == 0 else (..., j)] = (words >> np.uint32(bits * place)) & mask
    return out.reshape((R * per, C) if axis == 0 else (R, C * per))


def awq_layout(name, qweight, qzeros, scales, scheme: Scheme) -> UintGroups:
    """AutoAWQ GEMM: qweight uint32[K, N / 8] packed along the outputs in AWQ's order, qzeros uint32[K / g,
    N / 8] likewise, scales float32[K / g, N]; w[n, k] = scale * (q - zero)."""
    K, N = qweight.shape[0], qweight.shape[1] * 8
    _check_shapes(name, scheme, K, N, qzeros, scales)
    codes = unpack(np.ascontiguousarray(qweight.T), 4, 0, AWQ_NIBBLE)  # uint8[N, K]
    zeros = unpack(np.ascontiguousarray(qzeros.T), 4, 0, AWQ_NIBBLE)  # uint8[N, K / g]
    return _uint_groups(name, "AWQ", codes, zeros, scales.T)


def gptq_layout(
    name, qweight, qzeros, scales, g_idx, scheme: Scheme, fp16_scales: bool
) -> UintGroups | IntGroups:
    """AutoGPTQ: qweight uint32[K * bits / 32, N] packed along the inputs, qzeros uint32[K / g, N * bits /
    32] along the outputs (v1 stores zero - 1), scales float32[K / g, N], g_idx int32[K] the group of each
    input. 4 bits: UintGroups; 8 bits (zero 128): IntGroups of group 32 with the fp16 scales as stored
    (Q8_0's form), float32 where they were bf16."""
    bits = scheme.bits
    K, N = qweight.shape[0] * 32 // bits, qweight.shape[1]
    group = _check_shapes(name, scheme, K, N, qzeros, scales)
    if g_idx is not None and not np.array_equal(g_idx, np.arange(K) // group):
        # act-order (desc_act): consecutive inputs belong to scattered groups
        raise ValueError(
            f"tensor {name!r} (GPTQ): g_idx is not input // group_size (desc_act with a real permutation), "
            f"which is not supported"
        )
    codes = unpack(np.ascontiguousarray(qweight.T), bits, 1)  # uint8[N, K]
    zeros = unpack(np.ascontiguousarray(qzeros.T), bits, 0) + np.int32(scheme.zero_offset)  # int32[N, K / g]
    if bits == 4:
        return _uint_groups(name, "GPTQ", codes, zeros, scales.T)
    if not (zeros == 128).all():
        raise ValueError(f"tensor {name!r} (GPTQ 8-bit): a zero point is not 128 (asymmetric), not supported")
    values = (codes ^ np.uint8(0x80)).view(np.int8)  # int8[N, K]: q - 128
    scale = np.repeat(scales.T, group // 32, axis=1).astype(np.float16 if fp16_scales else np.float32)
    return IntGroups(values, np.ascontiguousarray(scale), 32, 8, (N, K), "GPTQ")


def _check_shapes(name: str, scheme: Scheme, K: int, N: int, qzeros, scales) -> int:
    """The group size the scales' shape gives, checked against the zero points' and the config's."""
    groups = scales.shape[0]
    group = K // max(groups, 1)
    prefix = name.removesuffix("qweight")
    for part, array, want in (
        ("scales", scales, (groups, N)),
        ("qzeros", qzeros, (groups, N * scheme.bits // 32)),
    ):
        if array.shape != want or group * groups != K or group % UINT_GROUP:
            raise ValueError(
                f"tensor {prefix + part!r} has shape {list(array.shape)}: {scheme.method} with {K} inputs "
                f"and {N} outputs needs [{K} / group size, {want[1]}], the group size a multiple of "
                f"{UINT_GROUP} that divides {K}"
            )
    if scheme.group not in (group, -1) or (scheme.group == -1 and groups != 1):
        raise ValueError(f"tensor {name!r}: groups of {group} inputs, but group_size is {scheme.group}")
    return group


def _uint_groups(name, source, codes, zeros, scales) -> UintGroups:
    """UintGroups from codes uint8[N, K], zero points [N, K / g] and scales float32[N, K / g]: each group
    of g is g / 32 groups of 32 with its scale, and minimum = scale * zero, exact in float32 (an fp16 or
    bf16 scale times a zero point of at most 5 bits)."""
    if not np.isfinite(scales).all():
        # inf * q - inf * zero is NaN where scale * (q - zero) is not: exact only while finite
        raise ValueError(f"tensor {name!r} ({source}): a scale is not finite")
    N, K = codes.shape
    repeat = K // scales.shape[1] // UINT_GROUP
    scale = np.repeat(scales, repeat, axis=1)  # float32[N, K / 32]
    minimum = scale * np.repeat(zeros, repeat, axis=1).astype(np.float32)
    # UintGroups.low: byte i of a group holds code i in its low nibble and code i + 16 in its high one
    halves = codes.reshape(N, K // UINT_GROUP, 2, UINT_GROUP // 2)
    low = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(N, K // 2)  # uint8[N, K / 2]
    return UintGroups(low, None, np.ascontiguousarray(scale), minimum, 4, (N, K), source)


def fp8_layout(name, weight, weight_scale, input_scale=None) -> Fp8Rows:
    """weight uint8[N, K] (E4M3FN bytes), weight_scale float32 of one value (per tensor) or [N] / [N, 1]
    (per channel), input_scale float32 of one value or None."""
    N = weight.shape[0]
    if weight.ndim != 2:
        raise ValueError(f"tensor {name!r} (FP8) must be a matrix, got shape {list(weight.shape)}")
    if weight_scale.size == 1:
        scale = np.full(N, weight_scale.reshape(()), np.float32)  # float32[N]
    elif weight_scale.shape in ((N,), (N, 1)):
        scale = np.ascontiguousarray(weight_scale.reshape(N), dtype=np.float32)
    else:
        raise ValueError(
            f"tensor {name.removesuffix('weight') + 'weight_scale'!r} has shape {list(weight_scale.shape)}; "
            f"FP8 scales are per tensor or per output channel ([{N}, 1]), not per group or block"
        )
    if input_scale is not None and input_scale.size != 1:
        raise ValueError(
            f"tensor {name.removesuffix('weight') + 'input_scale'!r} has shape {list(input_scale.shape)}; "
            f"a static input scale is one value"
        )
    given = None if input_scale is None else float(input_scale.reshape(()))
    return Fp8Rows(np.ascontiguousarray(weight), scale, given, weight.shape, "FP8")
