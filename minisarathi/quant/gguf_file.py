"""A GGUF file as a model: its config and weights, read from the file's header and data with NumPy alone
(its tokenizer: minisarathi/quant/gguf_tokenizer.py).

The hyper-parameters come from the `{arch}.*` metadata, and each tensor is converted with
minisarathi/quant/layouts.py. Quantized matrices (the layers' projections, the embedding table and lm_head)
stay in their layouts, IntGroups or UintGroups, and F32/F16/BF16 tensors as stored, views of the file (a
backend widens what it has no kernel for when it places it). Tensors are renamed to the Hugging Face names
that model/loader.py fuses, so a GGUF file goes through the same checks and fusion as a safetensors folder.

llama.cpp's converter reorders the rows of a llama model's attn_q and attn_k (and their biases) so that
ggml's RoPE, which rotates adjacent pairs (x[2i], x[2i+1]), computes what Hugging Face's rotate_half
computes on the pairs (x[i], x[i + D/2]). minisarathi's RoPE is the half-split one, so those rows are put
back. Qwen2 files are converted without that reordering (ggml rotates them in the NeoX, half-split way).
Gemma 3 files (not reordered either) hold each RMSNorm's 1 + w, which model/gemma.py then takes as is.
"""

from __future__ import annotations

import logging
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minisarathi.dtypes import dtype_name, to_float32
from minisarathi.quant.layouts import BLOCKS, from_gguf, take_rows, tensor_type, type_name

log = logging.getLogger("minisarathi.gguf")

MAGIC = b"GGUF"
# general.architecture -> (Hugging Face architecture, whether the converter permuted Q/K for ggml's RoPE)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
}
# ggml tensor names (after "blk.N.") -> the Hugging Face names model/loader.py reads
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's four norms per layer: llama.cpp's ffn_norm is its pre-feedforward norm
GEMMA3_LAYER_TENSORS = {
    **LAYER_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# of the Hugging Face names: the matrices kept quantized, the linear weights and the embedding table (its
# rows are gathered; a tied lm_head multiplies by it)
QUANTIZED_WEIGHTS = tuple(f"{p}_proj.weight" for p in "qkvo") + ("gate_proj.weight", "up_proj.weight")
QUANTIZED_WEIGHTS += ("down_proj.weight", "lm_head.weight", "embed_tokens.weight")
DENSE_TYPES = ("F32", "F16", "BF16")  # stored as plain arrays (layouts.Dense): no conversion


class UnsupportedGGUF(ValueError):
    """A GGUF file whose architecture, tokenizer or hyper-parameters this loader does not handle."""


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic (a model folder is not)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == MAGIC


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file's header: its dimensions in ggml's order (a matrix's row length first),
    its GGUF type (ggml_type's number) and where its data starts, in bytes from the start of the file."""

    shape: tuple[int, ...]
    type: int
    offset: int


# GGUF value types (gguf.GGUFValueType) -> NumPy dtype; 8 is a string, 9 an array
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8"}
_SCALARS.update({11: "<i8", 12: "<f8"})
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32  # of the data section and each tensor's data, where general.alignment is absent


def read_header(path: str | Path) -> tuple[dict, dict[str, TensorInfo]]:
    """(every key-value field as Python values, as gguf's ReaderField.contents() gives them; each tensor's
    TensorInfo), read from the file's header alone. gguf.GGUFReader makes a NumPy view of every string,
    which for Llama 3's 128k tokens and 280k merges took 47 s and 616 MiB on a 2-core VM; this takes about
    a second."""
    import mmap

    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _Header(data).read()
        except (struct.error, ValueError) as e:  # a cut or corrupt header: past the end, bad UTF-8
            raise ValueError(f"{path}: not a readable GGUF file ({e})") from None


class _Header:
    """A cursor over a GGUF file's header (little-endian, version 2 or 3)."""

    def __init__(self, data):
        self.data, self.at = data, 0

    def read(self) -> tuple[dict, dict[str, TensorInfo]]:
        if self.data[:4] != MAGIC:
            raise ValueError("no GGUF magic")
        self.at = 4
        version = self.scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3, little-endian)")
        n_tensors, n_fields = self.scalar(10), self.scalar(10)
        fields = {}
        for _ in range(n_fields):
            name = self.string()
            fields[name] = self.value(self.scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            shape = tuple(self.scalar(10) for _ in range(self.scalar(4)))
            infos.append((name, shape, self.scalar(4), self.scalar(10)))  # the offset: from the data's start
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"general.alignment {alignment!r} is not a positive integer")
        data = -(-self.at // alignment) * alignment  # the data section starts at the next aligned byte
        tensors = {}
        for name, shape, kind, at in infos:
            if name in tensors:
                raise ValueError(f"two tensors are named {name!r}")
            tensors[name] = TensorInfo(shape, kind, data + at)
        return fields, tensors

    def scalar(self, kind: int):
        dtype = np.dtype(_SCALARS[kind])
        value = np.frombuffer(self.data, dtype, 1, self.at)[0].item()
        self.at += dtype.itemsize
        return value

    def string(self) -> str:
        (size,) = struct.unpack_from("<Q", self.data, self.at)
        start, self.at = self.at + 8, self.at + 8 + size
        if self.at > len(self.data):
            raise ValueError("a string runs past the end")
        return self.data[start : self.at].decode("utf-8")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            if kind not in _SCALARS:
                raise ValueError(f"unknown value type {kind}")
            return self.scalar(kind)
        item, count = self.scalar(4), self.scalar(10)
        if item in _SCALARS:  # numbers in one read
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self.data, dtype, count, self.at).tolist()
            self.at += dtype.itemsize * count
            return values
        return [self.value(item) for _ in range(count)]


def metadata(path: str | Path) -> dict:
    """Every key-value field of the file, as Python values (strings, numbers, lists)."""
    return read_header(path)[0]


def architecture(meta: dict, path) -> tuple[str, str, bool]:
    """(ggml architecture, Hugging Face architecture, Q/K permuted) or UnsupportedGGUF naming it."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedGGUF(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return arch, *ARCHITECTURES[arch]


def _float(value) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-05, not 9.99...e-06)."""
    return float(str(np.float32(value)))


def config_dict(path) -> dict:
    """A Hugging Face config.json dict of the file's model, for ModelConfig.from_dict."""
    return header_config(*read_header(path), path)


def header_config(meta: dict, infos: dict[str, TensorInfo], path) -> dict:
    """config_dict from the header read_header gave."""
    arch, hf_arch, _ = architecture(meta, path)
    names = set(infos)

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedGGUF(f"{path}: the metadata has no {arch}.{key}")
        return value

    if "rope_freqs.weight" in names:  # Llama 3.1's scaled frequencies, stored as a tensor
        raise UnsupportedGGUF(
            f"{path}: tensor 'rope_freqs.weight' (per-frequency RoPE factors) is not supported"
        )
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length") or hidden // heads
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise UnsupportedGGUF(
            f"{path}: {arch}.rope.dimension_count {rotary} != head_dim {head_dim} (partial RoPE)"
        )
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling_type, "factor": _float(get("rope.scaling.factor"))}
        if scaling_type == "yarn":  # beta_fast and beta_slow: transformers' defaults, as llama.cpp's
            rope_scaling["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    elif scaling_type == "none":
        rope_scaling = None
    else:
        raise UnsupportedGGUF(
            f"{path}: {arch}.rope.scaling.type {scaling_type!r} is not supported (linear, yarn, none)"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    embed = infos["token_embd.weight"].shape if "token_embd.weight" in infos else None
    if tokens is None and embed is None:
        raise UnsupportedGGUF(
            f"{path}: neither tokenizer.ggml.tokens nor token_embd.weight gives the vocabulary"
        )
    config = {
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": _float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _float(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "vocab_size": len(tokens) if tokens is not None else embed[-1],
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": hf_arch == "LlamaForCausalLM" and "blk.0.attn_q.bias" in names,
        "dtype": "float32",  # what the weights are after dequantization
    }
    return config if arch != "gemma3" else {**config, **gemma3_config(meta, config)}


def gemma3_config(meta: dict, config: dict) -> dict:
    """Gemma 3's fields as llama.cpp reads them: a window (where gemma3.attention.sliding_window is given
    and positive) on every layer but each sixth, whose RoPE base is 10000 unscaled; the attention scale
    from head_dim but for the 62-layer 27B's hidden/heads; the norms' weights stored as 1 + w."""
    window, layers = meta.get("gemma3.attention.sliding_window", 0), config["num_hidden_layers"]
    full = [not window or (i + 1) % 6 == 0 for i in range(layers)]
    softcap = meta.get("gemma3.final_logit_softcapping")
    return {
        "sliding_window": window or config["max_position_embeddings"],  # no window: every layer is full
        "layer_types": ["full_attention" if f else "sliding_attention" for f in full],
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"]
        if layers == 62
        else config["head_dim"],
        "final_logit_softcapping": None if softcap is None else _float(softcap),
        "norms_include_one": True,
    }


def unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: within each head its converter interleaves the two halves of the
    rows (row i and row i + D/2 become rows 2i and 2i + 1); this puts them back as halves."""
    head_rows = rows.shape[0] // n_head
    return rows.reshape(n_head, head_rows // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # fused at load (model/loader.py)


def widen_mixed_fusions(tensors: dict) -> None:
    """Tensors the loader fuses keep their form only if all of them have one: all quantized (parts of
    different layouts fuse as a layouts.Stacked), or all float arrays of one dtype. Otherwise (a file may
    mix types within a layer) all become float32, so the fused weight has one form."""
    for name in [n for n in tensors if n.endswith(tuple(f".{p[0]}.weight" for p in FUSED))]:
        parts = next(p for p in FUSED if name.endswith(f".{p[0]}.weight"))
        names = [n for n in (name.replace(f".{parts[0]}.", f".{part}.") for part in parts) if n in tensors]
        if len({_form(tensors[n]) for n in names}) > 1:
            for n in names:
                t = tensors[n]
                tensors[n] = to_float32(t, dtype_name(t)) if isinstance(t, np.ndarray) else t.dequantize()


def _form(tensor) -> str:
    return tensor.dtype.name if isinstance(tensor, np.ndarray) else "quantized"


def read_gguf(path: str | Path, *, restore_rope_order: bool = True) -> dict:
    """name -> an IntGroups/UintGroups layout for a quantized matrix (QUANTIZED_WEIGHTS), else the array as
    stored (float32, float16, or bfloat16 bits as uint16; a quantized vector dequantized to float32), under
    the Hugging Face names model/loader.py reads.
    restore_rope_order=False keeps ggml's Q/K row order (a test's negative control)."""
    meta, infos = read_header(path)
    arch, _, permuted = architecture(meta, path)
    config = header_config(meta, infos, path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors, types = {}, Counter()
    file_bytes = 0
    mapped = np.memmap(path, dtype=np.uint8, mode="r")  # uint8[file size]; the float tensors are views
    with open(path, "rb") as file:
        for ggml_name, info in infos.items():
            name = hf_name(ggml_name, path, GEMMA3_LAYER_TENSORS if arch == "gemma3" else LAYER_TENSORS)
            tensors[name], nbytes = tensor_weights(name, ggml_name, info, file, mapped)
            types[type_name(info.type)] += 1
            file_bytes += nbytes
    if permuted and restore_rope_order:
        for name in [n for n in tensors if ".q_proj." in n or ".k_proj." in n]:
            tensors[name] = unpermute_rows(tensors[name], heads if ".q_proj." in name else kv_heads)
    widen_mixed_fusions(tensors)
    loaded_bytes = sum(t.nbytes for t in tensors.values())
    log.info(
        "%s: GGUF weights %s, %.2f MiB in the file; %.2f MiB at load (quantized matrices kept)",
        Path(path).name,
        ", ".join(f"{n} x{count}" for n, count in types.most_common()),
        file_bytes / 2**20,
        loaded_bytes / 2**20,
    )
    return tensors


def tensor_weights(name: str, ggml_name: str, info: TensorInfo, file, mapped: np.ndarray):
    """(tensor `ggml_name` as read_gguf returns it under its Hugging Face `name`, its bytes in the file).
    A float tensor is a view of `mapped`, the file's memory map; a quantized one is converted from its
    blocks read from `file`, not through the map, so that none of its pages stay mapped into the process,
    where they would count as resident for as long as any view of the map lives."""
    kind = tensor_type(ggml_name, info.type)  # UnsupportedTensorType names the tensor
    weights, block_bytes = BLOCKS[kind]
    row, *lead = info.shape
    if row % weights:
        raise ValueError(
            f"tensor {ggml_name!r} ({kind.name}): rows of {row} weights are no whole number of "
            f"{weights}-weight blocks"
        )
    shape = (*reversed(lead), row // weights * block_bytes)  # uint8[..., bytes per row], NumPy's order
    nbytes = math.prod(shape)
    if info.offset + nbytes > mapped.size:
        raise ValueError(f"tensor {ggml_name!r}: the file ends inside its data")
    if kind.name in DENSE_TYPES:
        view = mapped[info.offset : info.offset + nbytes].reshape(shape)
        return from_gguf(ggml_name, kind, view).data, nbytes
    blocks = np.empty(shape, dtype=np.uint8)
    file.seek(info.offset)
    file.readinto(blocks)
    layout = from_gguf(ggml_name, kind, blocks)
    return (layout if name.endswith(QUANTIZED_WEIGHTS) else layout.dequantize()), nbytes


def unpermute_rows(weights, n_head: int):
    """unpermute on an array, or on a quantized layout's rows (a row's groups and scales go with it)."""
    if isinstance(weights, np.ndarray):
        return unpermute(weights, n_head)
    return take_rows(weights, unpermute(np.arange(weights.shape[0]), n_head))


def hf_name(name: str, path, layer_tensors: dict[str, str] = LAYER_TENSORS) -> str:
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    block, _, rest = name.partition(".")
    layer, _, rest = rest.partition(".")
    if block == "blk" and layer.isdigit() and rest in layer_tensors:
        return f"model.layers.{layer}.{layer_tensors[rest]}"
    raise UnsupportedGGUF(f"{path}: tensor {name!r} is not one this loader knows")
