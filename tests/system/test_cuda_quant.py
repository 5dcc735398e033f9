"""quant_linear.cu on the CPU emulator: every weight format against float64 NumPy over the dequantized
weights, odd row counts, padded shapes, k splits, stacked parts, the quantized embedding, the fallbacks,
and whole GGUF models against the CPU backend's greedy tokens."""

from __future__ import annotations

import importlib.util
import logging
import platform
from pathlib import Path

import numpy as np
import pytest

from minisarathi.backends import cuda_ops, emulator
from minisarathi.backends.cuda_ops import QuantWeight
from minisarathi.dtypes import convert, to_float32
from minisarathi.model.families import load_model
from minisarathi.model.loader import CheckpointTensor
from minisarathi.quant.layouts import Fp8Rows, IntGroups, Stacked, UintGroups, pack_low
from minisarathi.testing import prefill_then_greedy

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)

ROOT = Path(__file__).parents[2]
# |kernel - float64| <= BOUND * (|x| @ (|scale * q| + |minimum|)^T), element by element: the fp16 scales
# and minimums (2^-11 of each), the weight rounded to the activation type for the mma (2^-11 in fp16,
# 2^-9 in bf16, of |w| <= |scale q| + |minimum|) and the output rounded once (the same, of |y|); the fp32
# accumulation of a few hundred products adds under 2^-16
BOUND = {"float16": 2.0**-9, "bfloat16": 2.0**-8}
N, K = 96, 160  # neither a multiple of the 64 x 64 tile: the packed weight is padded both ways
ROWS = [1, 3, 17, 70]  # the decode tile (<= 16 rows) and the prefill tile (64), with partial tiles


@pytest.fixture(params=["forward", "reverse"])
def order(request):
    with emulator.schedule(request.param):
        yield request.param


def make_layout(kind: str, rng, n: int = N, k: int = K):
    if kind == "Q8_0":
        values = rng.integers(-128, 128, (n, k)).astype(np.int8)
        return IntGroups(
            values, rng.uniform(1e-3, 1e-2, (n, k // 32)).astype(np.float16), 32, 8, (n, k), kind
        )
    if kind == "Q6_K":
        values = rng.integers(-32, 32, (n, k)).astype(np.int8)
        return IntGroups(
            values, rng.uniform(1e-3, 4e-2, (n, k // 16)).astype(np.float32), 16, 6, (n, k), kind
        )
    if kind in ("Q4_K", "AWQ"):
        codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
        scale = rng.uniform(1e-3, 2e-2, (n, k // 32)).astype(np.float32)
        if kind == "AWQ":  # group 128's scale and zero point repeated per 32, as hf_quantized maps them
            scale = np.repeat(scale[:, ::4], 4, axis=1)[:, : k // 32]
        minimum = scale * rng.integers(0, 16, scale.shape).astype(np.float32)
        return UintGroups(pack_low(codes), None, scale, minimum, 4, (n, k), kind)
    assert kind == "FP8"
    values = rng.integers(0, 0x7F, (n, k)).astype(np.uint8) | (
        rng.integers(0, 2, (n, k)).astype(np.uint8) << 7
    )
    return Fp8Rows(values, rng.uniform(1e-3, 1e-1, n).astype(np.float32), None, (n, k), kind)


def spread(layout) -> np.ndarray:
    """float64[N, K]: |scale * q| + |minimum| per weight, what the fp16 scales' rounding scales with."""
    if isinstance(layout, UintGroups):
        g = np.repeat(layout.scale, 32, axis=1) * layout.codes() + np.repeat(layout.minimum, 32, axis=1)
        return np.abs(g.astype(np.float64))
    return np.abs(layout.dequantize().astype(np.float64))


def device_x(rng, rows: int, dtype: str, k: int = K):
    return convert(rng.standard_normal((rows, k)).astype(np.float32), "float32", dtype)


def violations(layout, x, y, dtype: str, bias=None) -> int:
    """How many elements of y break the bound against float64 over the dequantized weights."""
    xf = to_float32(x, dtype).astype(np.float64)
    want = xf @ layout.dequantize().astype(np.float64).T
    if bias is not None:
        want += to_float32(bias, dtype)
    limit = BOUND[dtype] * (np.abs(xf) @ spread(layout).T) + 1e-6
    return int((np.abs(to_float32(y, dtype) - want) > limit).sum())


def place(ops, layout) -> QuantWeight:
    placed = ops.weight(CheckpointTensor("quantized", layout))
    assert isinstance(placed, QuantWeight)
    return placed


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_K", "AWQ", "FP8"])
def test_each_format_matches_float64(order, kind, dtype):
    rng = np.random.default_rng(1)
    ops = cuda_ops.emulated(dtype)
    layout = make_layout(kind, rng)
    w = place(ops, layout)
    # compact on the device: the codes in their own width (padded to 128 x 192), fp16 scales
    (part,) = w.parts
    assert part.packed.nbytes == 128 * 192 * (4 if kind in ("Q4_K", "AWQ") else 8) // 8
    assert part.scale.dtype == np.float16 and part.scale.shape == (192 // getattr(layout, "group", 32), 128)
    for rows in ROWS:
        x = device_x(rng, rows, dtype)
        assert violations(layout, x, ops.linear(x, w), dtype) == 0, (kind, rows)


@pytest.mark.parametrize("rows, splits", [(1, 2), (5, 3), (70, 2)])
def test_k_splits_sum_to_the_same_product(rows, splits):
    rng = np.random.default_rng(2)
    ops = cuda_ops.emulated("bfloat16")
    layout = make_layout("Q4_K", rng, k=320)  # 5 k tiles
    w = place(ops, layout)
    x = device_x(rng, rows, "bfloat16", k=320)
    bias = convert(rng.standard_normal(N).astype(np.float32), "float32", "bfloat16")
    assert violations(layout, x, ops.linear(x, w, bias, splits=splits), "bfloat16", bias) == 0


def test_the_split_choice_fills_the_gpu():
    # Llama-3-8B's o_proj at batch 1: 64 CTAs over 64 k tiles on 132 SMs -> 9 (launched as 8 of 8 tiles)
    assert cuda_ops._quant_splits(64, 64, 132) == 9
    assert cuda_ops._quant_splits(600, 64, 132) == 1  # enough CTAs already
    assert cuda_ops._quant_splits(2, 5, 132) == 1  # too few tiles to split


def test_a_corrupted_scale_is_caught():
    """Negative control: one fp16 scale on the device tripled breaks the bound where its group is used."""
    rng = np.random.default_rng(3)
    ops = cuda_ops.emulated("float16")
    layout = make_layout("Q8_0", rng)
    w = place(ops, layout)
    x = device_x(rng, 3, "float16")
    assert violations(layout, x, ops.linear(x, w), "float16") == 0
    w.parts[0].scale[2, 5] *= np.float16(3)  # [K / group, Np]: group 2 of output feature 5
    assert violations(layout, x, ops.linear(x, w), "float16") > 0


def test_stacked_parts_fill_their_columns_with_their_bias(order):
    """A Q4_K_M layer's fused q/k (Q4_K) and v (Q6_K): each part writes its own columns of one output."""
    rng = np.random.default_rng(4)
    ops = cuda_ops.emulated("float16")
    parts = (make_layout("Q4_K", rng, n=64), make_layout("Q6_K", rng, n=32))
    w = place(ops, Stacked(parts))
    bias = convert(rng.standard_normal(96).astype(np.float32), "float32", "float16")
    for rows in (2, 20):
        x = device_x(rng, rows, "float16")
        y = ops.linear(x, w, bias)
        for part, cols in zip(parts, (slice(0, 64), slice(64, 96))):
            assert violations(part, x, y[:, cols], "float16", bias[cols]) == 0


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "FP8"])
def test_a_quantized_embedding_table_gives_its_rows(kind):
    rng = np.random.default_rng(5)
    ops = cuda_ops.emulated("bfloat16")
    layout = make_layout(kind, rng)
    table = place(ops, layout)
    ids = np.array([0, 95, 7, 7, 64], np.int32)
    got = to_float32(ops.embedding(table, ids), "bfloat16")
    want = layout.dequantize().astype(np.float64)[ids]
    assert np.all(np.abs(got - want) <= 2.0**-8 * spread(layout)[ids] + 1e-7)
    with pytest.raises(ValueError, match="ids must be in"):
        ops.embedding(table, np.array([96], np.int32))


def test_unsupported_layouts_are_dequantized_with_one_log_line(caplog):
    rng = np.random.default_rng(6)
    five_bit = make_layout("Q4_K", rng)
    five_bit = UintGroups(
        five_bit.low, np.zeros((N, K // 8), np.uint8), five_bit.scale, five_bit.minimum, 5, (N, K), "Q5_K"
    )
    ops = cuda_ops.emulated("float16")
    with caplog.at_level(logging.INFO, logger="minisarathi.cuda"):
        placed = [ops.weight(CheckpointTensor("quantized", five_bit)) for _ in range(2)]
    assert all(isinstance(p, np.ndarray) and p.dtype == np.float16 for p in placed)
    assert len(caplog.records) == 1 and "Q5_K" in caplog.records[0].getMessage()
    # float32 activations have no tensor-core path: the dequantized weight, as before
    assert isinstance(
        cuda_ops.emulated().weight(CheckpointTensor("quantized", make_layout("Q8_0", rng))), np.ndarray
    )


def _kquant_file(tmp_path: Path, name: str) -> Path:
    spec = importlib.util.spec_from_file_location("make_kquant", ROOT / "tests/golden/make_kquant_gguf.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    return make.write(tmp_path, name)


@pytest.mark.parametrize("file", ["stories260K-q8_0.gguf", "kquant-q4_k_m.gguf"])
def test_gguf_models_give_the_reference_backends_greedy_tokens(file, tmp_path):
    """The bundled Q8_0 file and a generated Q4_K_M one (Q4_K with Q6_K parts, a quantized embedding
    table), every quantized matrix on quant_linear.cu in float16, against the reference backend (float32
    over the dequantized weights; the CPU backend rounds activations to int8)."""
    path = (
        ROOT / "models/stories260K-gguf" / file
        if file.startswith("stories")
        else _kquant_file(tmp_path, file)
    )
    prompt = [1, *range(3, 400, 23)]
    _, want = prefill_then_greedy(load_model(path, device="reference"), prompt, 8)
    model = load_model(path, device="cuda-emulated", dtype="float16")
    assert isinstance(model.layers[0].qkv_proj, QuantWeight) and isinstance(model.embed_tokens, QuantWeight)
    # the weights take their quantized size on the device, not the 2 bytes a weight of float16
    weights = sum(np.prod(w.shape) for w in vars(model.layers[0]).values() if isinstance(w, QuantWeight))
    quantized = sum(w.nbytes for w in vars(model.layers[0]).values() if isinstance(w, QuantWeight))
    assert quantized < 1.2 * weights
    _, got = prefill_then_greedy(model, prompt, 8)
    assert got == want


@pytest.mark.parametrize("fmt", ["awq", "gptq8-sym", "fp8-channel"])
def test_quantized_folders_give_the_reference_backends_greedy_tokens(fmt, tmp_path):
    """AWQ (4-bit, zero points), GPTQ-8 and FP8 folders on quant_linear.cu in float16, against the
    reference backend."""
    spec = importlib.util.spec_from_file_location(
        "make_folders", ROOT / "tests/golden/make_quantized_folders.py"
    )
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    path = make.write_folder(tmp_path / fmt, fmt)
    prompt = [1, *range(3, 400, 23)]
    _, want = prefill_then_greedy(load_model(path, device="reference"), prompt, 8)
    model = load_model(path, device="cuda-emulated", dtype="float16")
    assert all(isinstance(getattr(model.layers[0], n), QuantWeight) for n in ("qkv_proj", "down_proj"))
    _, got = prefill_then_greedy(model, prompt, 8)
    assert got == want
