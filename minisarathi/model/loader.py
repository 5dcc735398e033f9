"""Hugging Face safetensors checkpoints (one file or index-sharded; F32/F16/BF16, or AWQ, GPTQ and FP8
linear weights: quant/hf_quantized.py) to the model's weights.

The safetensors format is an 8-byte little-endian header length, a JSON header mapping each tensor name
to its dtype, shape and byte range, then the raw data. Reading it with np.memmap ourselves (rather than
safetensors' numpy loader, which has no bfloat16) only pages in the tensors that are used.

Weights leave the loader as they are stored (CheckpointTensor: dtype name and raw array) and a backend
places them: NumPy widens them to float32, the CUDA backend uploads the stored bits and converts on the
device only when its compute dtype differs. An 8B bf16 checkpoint thus never becomes 32 GB of float32
on the host.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minisarathi.config import ModelConfig, read_json_object
from minisarathi.dtypes import dtype_name, to_float32
from minisarathi.model.phi3 import checkpoint_tensors, rotary_order
from minisarathi.quant.gguf_file import is_gguf, read_gguf
from minisarathi.quant.hf_quantized import quantized_linears
from minisarathi.quant.layouts import Layout, concatenate_rows

# safetensors dtype -> (our dtype name, NumPy dtype of the stored array). bfloat16 has no NumPy dtype:
# its bits are read as uint16 (minisarathi/dtypes.py); so are FP8's as uint8. I32 and F8_E4M3 are only
# read as the parts of quantized linears (quant/hf_quantized.py).
STORED_DTYPES = {
    "F32": ("float32", np.dtype("<f4")),
    "F16": ("float16", np.dtype("<f2")),
    "BF16": ("bfloat16", np.dtype("<u2")),
    "I32": ("int32", np.dtype("<i4")),
    "F8_E4M3": ("float8_e4m3", np.dtype("u1")),
}


@dataclass(frozen=True)
class CheckpointTensor:
    """One weight as the checkpoint stores it. NumPy code may use it as an array of its float32 values
    (np.asarray(tensor) widens it), which is how CpuOps.weight places it."""

    dtype: str  # "float32", "float16", "bfloat16", or "quantized" (a GGUF matrix in its layout)
    data: np.ndarray | Layout  # float32, float16, bfloat16 bits as uint16; or the layout (not Dense)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        # a float32 tensor comes back as it is, a view of the memory map
        values = self.data.dequantize() if self.dtype == "quantized" else to_float32(self.data, self.dtype)
        return np.asarray(values, dtype=dtype, copy=copy)


class CheckpointWeights(Mapping):
    """The model's weights under the names LlamaModel uses, as CheckpointTensors, q/k/v and gate/up fused.

    Keys: embed_tokens, norm, lm_head (untied only), and per layer i `layers.{i}.` + input_layernorm,
    post_attention_layernorm, config.extra_layer_norms (Gemma 3), qkv_proj, qkv_bias (if config.qkv_bias),
    q_norm and k_norm (if config.qk_norm), o_proj, o_bias (if config.o_bias), gate_up_proj, down_proj.
    Weights keep HF's [out, in] layout. Every tensor is checked when this is built; a fused one is
    concatenated (one host copy in the stored dtype) each time it is read, so the host holds at most one
    fused tensor while a backend places them one by one.
    """

    def __init__(self, stored: dict[str, CheckpointTensor], parts: dict[str, list[str]]):
        self._stored = stored  # checkpoint name -> tensor
        self._parts = parts  # our name -> the checkpoint names it concatenates, in order

    def __getitem__(self, name: str) -> CheckpointTensor:
        tensors = [self._stored[part] for part in self._parts[name]]
        if len(tensors) == 1:
            return tensors[0]
        return CheckpointTensor(tensors[0].dtype, concatenate_rows([t.data for t in tensors]))

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)


def load_weights(model_dir: str | Path, config: ModelConfig) -> Mapping[str, CheckpointTensor]:
    """The checkpoint's tensors, memory-mapped, under LlamaModel's names (CheckpointWeights, phi3.py)."""
    stored = checkpoint_tensors(read_checkpoint(model_dir), config)  # Gemma 3 multimodal, Phi-3: renamed
    c = config
    H, I = c.hidden_size, c.intermediate_size
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    expected: dict[str, tuple[int, ...]] = {}  # checkpoint name -> shape

    def use(*named_shapes: tuple[str, tuple[int, ...]]) -> list[str]:
        expected.update(named_shapes)
        return [name for name, _ in named_shapes]

    parts = {
        "embed_tokens": use(("model.embed_tokens.weight", (c.vocab_size, H))),
        "norm": use(("model.norm.weight", (H,))),
    }
    if not c.tie_word_embeddings:
        parts["lm_head"] = use(("lm_head.weight", (c.vocab_size, H)))
    for i in range(c.num_hidden_layers):
        attn, mlp, out = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", *c.extra_layer_norms):
            parts[out + norm] = use((f"model.layers.{i}.{norm}.weight", (H,)))
        qkv = (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size))
        parts[out + "qkv_proj"] = use(*((f"{attn}{name}.weight", (rows, H)) for name, rows in qkv))
        if c.qkv_bias:
            parts[out + "qkv_bias"] = use(*((f"{attn}{name}.bias", (rows,)) for name, rows in qkv))
        if c.qk_norm:
            parts[out + "q_norm"] = use((attn + "q_norm.weight", (c.head_dim,)))
            parts[out + "k_norm"] = use((attn + "k_norm.weight", (c.head_dim,)))
        parts[out + "o_proj"] = use((attn + "o_proj.weight", (H, q_size)))
        if c.o_bias:
            parts[out + "o_bias"] = use((attn + "o_proj.bias", (H,)))
        parts[out + "gate_up_proj"] = use(
            (mlp + "gate_proj.weight", (I, H)), (mlp + "up_proj.weight", (I, H))
        )
        parts[out + "down_proj"] = use((mlp + "down_proj.weight", (H, I)))

    for name, shape in expected.items():
        if name not in stored:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {str(model_dir)!r}")
        if stored[name].shape != shape:
            raise ValueError(f"tensor {name!r} has shape {list(stored[name].shape)}, expected {list(shape)}")
    for name, names in parts.items():
        dtypes = {stored[n].dtype for n in names}
        if len(dtypes) > 1:
            raise ValueError(
                f"tensors {', '.join(names)} (fused into {name}) must share one dtype, got "
                f"{', '.join(stored[n].dtype for n in names)}"
            )
    return rotary_order(CheckpointWeights(stored, parts), config)


def read_checkpoint(model_dir: str | Path) -> dict[str, CheckpointTensor]:
    """name -> memory-mapped tensor over model.safetensors or its index's shards (or a GGUF file's)."""
    model_dir = Path(model_dir)
    if is_gguf(model_dir):
        return {
            n: CheckpointTensor(dtype_name(d) if isinstance(d, np.ndarray) else "quantized", d)
            for n, d in read_gguf(model_dir).items()
        }
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = read_json_object(index_file).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_file} has no weight_map")
        files = sorted(set(weight_map.values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(
            f"model_dir {str(model_dir)!r} has neither model.safetensors nor model.safetensors.index.json"
        )
    tensors = {}
    for file in files:
        tensors.update(read_safetensors(model_dir / file))
    # from config.json's quantization_config
    for name, layout in quantized_linears(model_dir, tensors).items():
        tensors[name] = CheckpointTensor("quantized", layout)
    return tensors


def read_safetensors(file: Path) -> dict[str, CheckpointTensor]:
    """name -> tensor of one .safetensors file; the arrays are read-only views of a memmap."""
    if not file.is_file():
        raise ValueError(f"checkpoint file {str(file)!r} does not exist")
    data = np.memmap(file, dtype=np.uint8, mode="r").view(np.ndarray)  # plain arrays that share the mapping
    header_len = int(data[:8].view("<u8")[0]) if len(data) >= 8 else -1
    if not 0 < header_len <= len(data) - 8:
        raise ValueError(f"{file} is not a safetensors file (bad header length {header_len})")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: the safetensors header must be a JSON object")
    body = data[8 + header_len :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not (
            isinstance(info, dict)
            and isinstance(info.get("dtype"), str)
            and isinstance(info.get("shape"), list)
            and all(type(n) is int and n >= 0 for n in info["shape"])
            and isinstance(info.get("data_offsets"), list)
            and len(info["data_offsets"]) == 2
            and all(type(n) is int and n >= 0 for n in info["data_offsets"])
        ):
            raise ValueError(
                f"tensor {name!r} in {file} must have dtype, shape and data_offsets [begin, end]"
            )
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if dtype not in STORED_DTYPES:
            raise ValueError(
                f"tensor {name!r} in {file} has dtype {dtype}; supported: {', '.join(STORED_DTYPES)}"
            )
        stored_as, array_dtype = STORED_DTYPES[dtype]
        if end - begin != array_dtype.itemsize * int(np.prod(shape)) or end > len(body):
            raise ValueError(
                f"tensor {name!r} in {file} has data_offsets {[begin, end]} that do not fit "
                f"its shape {list(shape)}"
            )
        tensors[name] = CheckpointTensor(stored_as, body[begin:end].view(array_dtype).reshape(shape))
    return tensors
