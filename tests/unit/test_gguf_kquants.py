"""GGUF files of every quantized type as models, kept quantized: the random Llama of
tests/golden/make_kquant_gguf.py (256-wide rows, so K-quants hold them), one file per type and one in
Q4_K_M's mix, written into a temporary folder. Each is checked against a float64 forward over the gguf
package's own dequantization of the file, and for the bytes it keeps."""

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from minisarathi.config import ModelConfig  # noqa: E402
from minisarathi.model.families import load_model  # noqa: E402
from minisarathi.model.loader import load_weights, read_checkpoint  # noqa: E402
from minisarathi.quant.gguf_file import hf_name, read_gguf  # noqa: E402
from minisarathi.quant.layouts import IntGroups, Stacked, UintGroups  # noqa: E402
from minisarathi.testing import float64_logits, prefill_then_greedy, relative_error  # noqa: E402

ROOT = Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("make_kquant", ROOT / "tests/golden/make_kquant_gguf.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)

TYPES = list(make.FILES.values())
PROMPT = [1, *range(3, 400, 11)]  # 38 tokens
# the float32 forward's error against float64, relative to the largest logit: float32 sums over 768
# products in two layers; ggml's Q/K order left in place, or the unquantized weights (the negative
# controls), give errors hundreds of times larger
LOGITS_BOUND = 3e-6
# bytes a weight takes once loaded, from the layouts (docs/quantization.md, "The layouts"): the codes, then
# the scales (and minimums) of a group; F32 stays float32
LOADED_BYTES = {
    T.F32: 4,
    T.Q8_0: 1 + 2 / 32,
    T.Q6_K: 1 + 4 / 16,
    T.Q4_0: 1 / 2 + 8 / 32,
    T.Q4_K: 1 / 2 + 8 / 32,
    T.Q5_K: 5 / 8 + 8 / 32,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("kquant")
    return {types: make.write(out, name) for name, types in make.FILES.items()}


def dequantized(path: Path) -> dict[str, np.ndarray]:
    """HF name -> float32 weights from gguf.quants.dequantize of the file's blocks, Q/K rows put back in
    Hugging Face's order by inverting the writer's permutation."""
    config = ModelConfig.from_pretrained(path)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    weights = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        kind = tensor.name.split(".")[-2]
        if kind in heads:
            order = make.make_gguf.permute(np.arange(values.shape[0]), heads[kind])
            values = values[np.argsort(order)]
        weights[hf_name(tensor.name, path)] = values
    return weights


def fused(config, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face names -> load_weights' names, q/k/v and gate/up stacked (float64_logits reads those)."""
    out = {"embed_tokens": weights["model.embed_tokens.weight"], "norm": weights["model.norm.weight"]}
    if "lm_head.weight" in weights:
        out["lm_head"] = weights["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        hf = {k.removeprefix(f"model.layers.{i}.").removesuffix(".weight"): v for k, v in weights.items()}
        parts = {
            "input_layernorm": ["input_layernorm"],
            "qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            "o_proj": ["self_attn.o_proj"],
            "post_attention_layernorm": ["post_attention_layernorm"],
            "gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
            "down_proj": ["mlp.down_proj"],
        }
        out.update({f"layers.{i}.{n}": np.concatenate([hf[p] for p in ps]) for n, ps in parts.items()})
    return out


def test_the_script_writes_the_same_bytes_again(files, tmp_path):
    for path in files.values():
        assert make.write(tmp_path, path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("types", TYPES)
def test_every_matrix_stays_in_its_layout(files, types):
    path = files[types]
    reader = gguf.GGUFReader(str(path))
    stored = read_checkpoint(path)
    want = dequantized(path)
    for tensor in reader.tensors:
        name, kind = hf_name(tensor.name, path), T(tensor.tensor_type)
        got = stored[name]
        if kind == T.F32:
            assert got.dtype == "float32", name
        else:
            assert got.dtype == "quantized" and got.data.source == kind.name, name
            layout = IntGroups if kind in (T.Q8_0, T.Q6_K) else UintGroups
            assert isinstance(got.data, layout), name
        assert np.array_equal(np.asarray(got), want[name]), name  # bit for bit, un-permuted
    kinds = {T(t.tensor_type).name for t in reader.tensors} - {"F32"}
    assert kinds == ({"Q4_K", "Q6_K"} if types == "Q4_K_M" else {types})


def test_q4_k_m_fuses_mixed_layers_as_stacked_parts(files):
    config = ModelConfig.from_pretrained(files["Q4_K_M"])
    weights = load_weights(files["Q4_K_M"], config)
    # layer 0 is all Q4_K; layer 1 keeps attn_v and ffn_down in Q6_K (use_more_bits), as llama.cpp's mix
    assert isinstance(weights["layers.0.qkv_proj"].data, UintGroups)
    qkv = weights["layers.1.qkv_proj"].data
    assert isinstance(qkv, Stacked) and [p.source for p in qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    assert isinstance(weights["layers.1.down_proj"].data, IntGroups)
    assert isinstance(weights["lm_head"].data, IntGroups) and weights["lm_head"].data.source == "Q6_K"
    assert isinstance(weights["embed_tokens"].data, UintGroups)


@pytest.mark.parametrize("types", TYPES)
def test_logits_equal_a_float64_forward_over_the_dequantized_weights(files, types):
    # on the reference backend; CpuOps' int8-activation kernels: tests/unit/test_quant_linear_models.py
    path = files[types]
    config = ModelConfig.from_pretrained(path)
    want = float64_logits(config, fused(config, dequantized(path)), PROMPT)
    got, _ = prefill_then_greedy(load_model(path, device="reference"), PROMPT, 1)
    assert relative_error(got, want) <= LOGITS_BOUND


def test_the_reference_tells_wrong_weights_apart(files):
    path = files["Q4_K_M"]
    config = ModelConfig.from_pretrained(path)
    got, _ = prefill_then_greedy(load_model(path, device="reference"), PROMPT, 1)
    weights = dequantized(path)
    for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight"))]:
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        weights[name] = make.make_gguf.permute(weights[name], heads)  # ggml's Q/K order
    assert relative_error(got, float64_logits(config, fused(config, weights), PROMPT)) > 100 * LOGITS_BOUND
    unquantized = load_weights(path.parent / "kquant-f32", config)
    assert relative_error(got, float64_logits(config, unquantized, PROMPT)) > 100 * LOGITS_BOUND


@pytest.mark.parametrize("types", ["Q4_K_M", "Q5_K"])
def test_greedy_tokens_do_not_depend_on_the_chunk_size(files, types):
    model = load_model(files[types], device="reference")
    runs = [prefill_then_greedy(model, PROMPT, 24, chunk_size=size) for size in (len(PROMPT), 16, 5)]
    assert runs[1][1] == runs[0][1] and runs[2][1] == runs[0][1]
    assert relative_error(runs[2][0], runs[0][0]) <= LOGITS_BOUND


@pytest.mark.parametrize("types", TYPES)
def test_loaded_bytes_are_the_layouts_of_the_files_types(files, types):
    path = files[types]
    reader = gguf.GGUFReader(str(path))
    want = sum(LOADED_BYTES[T(t.tensor_type)] * int(t.n_elements) for t in reader.tensors)
    loaded = sum(t.data.nbytes for t in read_checkpoint(path).values())
    assert loaded == want  # nothing widened to float32
    ratio = loaded / path.stat().st_size
    print(f"{types}: {loaded:,} bytes loaded, {ratio:.3f} of the file")
    # Q8_0 and Q5_K are within 1.3x of the file; Q4_0 and Q4_K take 4/3 (float32 scale and minimum per 32
    # weights) and Q6_K 1.52 (int8 values): a kernel's own form must be smaller to reach 1.3x
    if types in ("Q8_0", "Q5_K"):
        assert ratio <= 1.3


@pytest.mark.parametrize("types", ["Q4_K_M", "Q5_K", "Q6_K"])
def test_sharding_keeps_the_layouts_and_slices_whole_groups(files, types):
    from minisarathi.parallel.sharding import shard_weights

    config = ModelConfig.from_pretrained(files[types])
    weights = load_weights(files[types], config)
    assert (types == "Q4_K_M") == isinstance(weights["layers.1.qkv_proj"].data, Stacked)
    for rank in range(2):
        shard = shard_weights(weights, config, rank, 2)
        for name, tensor in shard.items():
            full = np.asarray(weights[name])
            assert tensor.dtype == weights[name].dtype, name
            kind = name.rsplit(".", 1)[-1]
            q, kv = (config.num_attention_heads * 64, config.num_key_value_heads * 64)
            i = config.intermediate_size
            if kind == "qkv_proj":
                rows = [
                    range(r0 + rank * n // 2, r0 + (rank + 1) * n // 2)
                    for r0, n in ((0, q), (q, kv), (q + kv, kv))
                ]
                want = full[np.concatenate([np.array(r) for r in rows])]
            elif kind == "gate_up_proj":
                want = full[
                    np.r_[rank * i // 2 : (rank + 1) * i // 2, i + rank * i // 2 : i + (rank + 1) * i // 2]
                ]
            elif kind == "o_proj":
                want = full[:, rank * q // 2 : (rank + 1) * q // 2]
            elif kind == "down_proj":
                want = full[:, rank * i // 2 : (rank + 1) * i // 2]
            else:
                want = full
            got = np.asarray(tensor)
            assert np.array_equal(got, want), name
            if tensor.dtype == "quantized":  # compact: as many bytes as its share of the weights
                assert tensor.data.nbytes * full.size == pytest.approx(weights[name].data.nbytes * got.size)


def test_a_shard_that_splits_a_group_is_refused_with_the_tensor_named(files):
    from minisarathi.parallel.sharding import shard_weights

    config = ModelConfig.from_pretrained(files["Q8_0"])
    weights = load_weights(files["Q8_0"], config)
    # 768 intermediate columns over 16 ranks are 48 each: down_proj's groups of 32 would split
    wide = dataclasses.replace(config, num_attention_heads=16, num_key_value_heads=16)
    with pytest.raises(ValueError, match=r"layers\.0\.down_proj: columns 48\.\.96 split a Q8_0 group of 32"):
        shard_weights({"layers.0.down_proj": weights["layers.0.down_proj"]}, wide, 1, 16)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the map's resident size in smaps")
def test_quantized_blocks_are_read_from_the_file_not_through_the_map(files):
    # Pages read through the file's map stay mapped into the process, counted as resident, while any
    # view of the map lives (the float32 norms are views). So the quantized blocks must come from plain
    # reads: with every quantized weight converted and read, and no float one, none of the map is resident.
    path = files["Q4_K_M"]
    tensors = read_gguf(path)
    quantized = [t for t in tensors.values() if not isinstance(t, np.ndarray)]
    assert len(quantized) == len(tensors) - 5  # all but the 5 float32 norms
    for tensor in quantized:
        np.asarray(tensor).sum()
    assert mapped_resident_bytes(path) == [0]  # the map lives (the norms' views), none of it resident


def mapped_resident_bytes(path: Path) -> list[int]:
    """The resident bytes of each of this process's maps of `path`, from /proc/self/smaps."""
    resident, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if (
            "-" in head[0] and len(head) >= 5
        ):  # a mapping's first line: range, perms, offset, dev, inode, path
            inside = line.endswith(str(path.resolve()))
        elif inside and head[0] == "Rss:":
            resident.append(int(head[1]) * 1024)
    return resident
