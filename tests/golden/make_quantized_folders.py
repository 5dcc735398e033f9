"""Tiny random Llama folders quantized as AutoAWQ, AutoGPTQ and FP8 tools publish them, for the tests.

Each linear weight gets random codes, zero points and scales, packed into the tensors the tools write
(AutoAWQ's GEMM order, AutoGPTQ's v1 zero points, compressed-tensors' E4M3 bytes and scales); the
embeddings, norms and lm_head stay 16-bit, as those tools leave them. Nothing is committed: the tests write
the folders into a temporary directory (`write_folder(path, fmt)`), or by hand:
    python tests/golden/make_quantized_folders.py OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "models" / "stories260K"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SHAPE = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=512)
GROUP = 128
FORMATS = ("awq", "gptq4-sym", "gptq4-asym", "gptq8-sym", "fp8-tensor", "fp8-channel")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM pack: nibble i of a word holds column AWQ_ORDER[i]
# safetensors names of the NumPy dtypes written here; FP8 bytes are written from uint8 arrays
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "int32": "I32", "uint16": "BF16"}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A .safetensors file of name -> (safetensors dtype, array of its bytes), in name order."""
    header, offset = {}, 0
    for name, (dtype, array) in sorted(tensors.items()):
        nbytes = array.nbytes
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for _, (_, array) in sorted(tensors.items()):
            f.write(np.ascontiguousarray(array).tobytes())


def plain(array: np.ndarray) -> tuple[str, np.ndarray]:
    return SAFETENSORS_DTYPES[array.dtype.name], array


def bf16(values: np.ndarray) -> tuple[str, np.ndarray]:
    """bfloat16 bits of float32 values that are bfloat16 already (the low 16 bits zero)."""
    bits = values.astype(np.float32).view(np.uint32)
    assert not (bits & 0xFFFF).any()
    return "BF16", (bits >> 16).astype(np.uint16)


def pack_awq(values: np.ndarray) -> np.ndarray:
    """int32[rows, cols / 8] from 4-bit values [rows, cols], packed along cols as AutoAWQ's GEMM does."""
    rows, cols = values.shape
    packed = np.zeros((rows, cols // 8), np.uint32)
    for col in range(cols // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << np.uint32(4 * i)
    return packed.view(np.int32)


def pack_sequential(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words of `bits`-bit values packed along `axis` as AutoGPTQ does: value j of each run of
    32 / bits at bits * j."""
    per = 32 // bits
    moved = np.moveaxis(values.astype(np.uint32), axis, 0)
    packed = np.zeros((moved.shape[0] // per, *moved.shape[1:]), np.uint32)
    for row in range(packed.shape[0]):
        for j in range(per):
            packed[row] |= moved[row * per + j] << np.uint32(bits * j)
    return np.moveaxis(packed, 0, axis).view(np.int32)


def fp16_scales(rng, shape) -> np.ndarray:
    return (rng.uniform(0.5, 1.5, shape) * 8e-3).astype(np.float16)


def awq_tensors(rng, out_features: int, in_features: int) -> dict:
    codes = rng.integers(0, 16, (out_features, in_features))
    zeros = rng.integers(0, 16, (out_features, in_features // GROUP))
    scales = fp16_scales(rng, (in_features // GROUP, out_features))
    # AutoAWQ stores [in, out]: intweight transposed, then packed along out
    return {
        "qweight": plain(pack_awq(codes.T)),
        "qzeros": plain(pack_awq(zeros.T)),
        "scales": plain(scales),
    }


def gptq_tensors(rng, out_features: int, in_features: int, bits: int, sym: bool) -> dict:
    codes = rng.integers(0, 1 << bits, (out_features, in_features))
    middle = 1 << (bits - 1)
    shape = (out_features, in_features // GROUP)
    zeros = np.full(shape, middle) if sym else rng.integers(1, (1 << bits) + 1, shape)
    return {
        "qweight": plain(pack_sequential(codes.T, bits, axis=0)),  # [in * bits / 32, out]
        "qzeros": plain(pack_sequential(zeros.T - 1, bits, axis=1)),  # v1 stores zero - 1
        "scales": plain(fp16_scales(rng, (in_features // GROUP, out_features))),
        "g_idx": plain((np.arange(in_features) // GROUP).astype(np.int32)),
    }


def e4m3_bytes(rng, shape) -> np.ndarray:
    """Random E4M3FN bytes of magnitude at most 16 (no NaN)."""
    exponent_mantissa = np.arange(128)
    small = exponent_mantissa[exponent_mantissa <= (7 + 4) << 3]  # up to 2 ** 4
    byte = rng.choice(small, shape) | (rng.integers(0, 2, shape) << 7)
    return byte.astype(np.uint8)


def fp8_tensors(rng, out_features: int, in_features: int, per_channel: bool) -> dict:
    weight = ("F8_E4M3", e4m3_bytes(rng, (out_features, in_features)))
    if per_channel:  # compressed-tensors' FP8_DYNAMIC: bf16 scales per output channel, no input scale
        scale = np.float32(2.0**-14) * rng.integers(64, 256, (out_features, 1)).astype(np.float32)
        return {"weight": weight, "weight_scale": bf16(scale)}
    return {
        "weight": weight,
        "weight_scale": plain(np.array([rng.uniform(4e-3, 8e-3)], np.float32)),
        "input_scale": plain(np.array([rng.uniform(0.01, 0.05)], np.float32)),
    }


def quantization_config(fmt: str) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    if fmt.startswith("gptq"):
        return {
            "quant_method": "gptq",
            "bits": 8 if fmt.startswith("gptq8") else 4,
            "group_size": GROUP,
            "sym": fmt.endswith("-sym"),
            "desc_act": False,
            "checkpoint_format": "gptq",
        }
    channel = fmt == "fp8-channel"
    inputs = {"num_bits": 8, "type": "float", "symmetric": True}
    inputs |= {"strategy": "token", "dynamic": True} if channel else {"strategy": "tensor", "dynamic": False}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "dynamic": False,
                    "strategy": "channel" if channel else "tensor",
                },
                "input_activations": inputs,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def linear_tensors(fmt: str, rng, out_features: int, in_features: int) -> dict:
    if fmt == "awq":
        return awq_tensors(rng, out_features, in_features)
    if fmt.startswith("gptq"):
        return gptq_tensors(
            rng, out_features, in_features, 8 if fmt.startswith("gptq8") else 4, "-sym" in fmt
        )
    return fp8_tensors(rng, out_features, in_features, fmt == "fp8-channel")


def write_folder(path, fmt: str, seed: int = 0) -> Path:
    """A Llama of SHAPE in format `fmt` (one of FORMATS) at `path`, the same for the same seed."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    H, I, V = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["vocab"]
    D = H // SHAPE["heads"]
    fp8 = fmt.startswith("fp8")

    def half(*shape, std=0.02, offset=0.0):
        values = (offset + std * rng.standard_normal(shape)).astype(np.float32)
        if fp8:  # FP8 models are bf16 around their linears
            return bf16((values.view(np.uint32) & 0xFFFF0000).view(np.float32))
        return plain(values.astype(np.float16))

    tensors = {
        "model.embed_tokens.weight": half(V, H, std=1.0),
        "model.norm.weight": half(H, std=0.1, offset=1.0),
        "lm_head.weight": half(V, H),
    }
    linears = {
        "self_attn.q_proj": (SHAPE["heads"] * D, H),
        "self_attn.k_proj": (SHAPE["kv_heads"] * D, H),
        "self_attn.v_proj": (SHAPE["kv_heads"] * D, H),
        "self_attn.o_proj": (H, SHAPE["heads"] * D),
        "mlp.gate_proj": (I, H),
        "mlp.up_proj": (I, H),
        "mlp.down_proj": (H, I),
    }
    for i in range(SHAPE["layers"]):
        prefix = f"model.layers.{i}."
        tensors[prefix + "input_layernorm.weight"] = half(H, std=0.1, offset=1.0)
        tensors[prefix + "post_attention_layernorm.weight"] = half(H, std=0.1, offset=1.0)
        for name, (out_features, in_features) in linears.items():
            for part, tensor in linear_tensors(fmt, rng, out_features, in_features).items():
                tensors[f"{prefix}{name}.{part}"] = tensor
    write_safetensors(path / "model.safetensors", tensors)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": SHAPE["layers"],
        "num_attention_heads": SHAPE["heads"],
        "num_key_value_heads": SHAPE["kv_heads"],
        "head_dim": D,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": V,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16" if fp8 else "float16",
        "quantization_config": quantization_config(fmt),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER / name, path / name)
    return path


if __name__ == "__main__":
    for fmt in FORMATS:
        print(write_folder(Path(sys.argv[1]) / fmt, fmt))
