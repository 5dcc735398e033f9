"""Writes a Hugging Face Llama/Qwen2/Qwen3/Gemma 3 folder (safetensors) as a GGUF file, as llama.cpp's
convert_hf_to_gguf.py would: its metadata keys, tensor names, Q/K row order for llama, Gemma's norms
stored as 1 + w, F32 norms and F16 for a matrix whose rows are no whole number of Q8_0 blocks. The
tokenizer metadata comes from the folder's tokenizer.json (SentencePiece BPE), with each piece's score
minus its id, SentencePiece's order.

    python tests/golden/make_gguf.py        # models/stories260K -> models/stories260K-gguf/*.gguf
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from minisarathi.config import ModelConfig  # noqa: E402
from minisarathi.model.loader import read_checkpoint  # noqa: E402
from minisarathi.quant.kquants import TYPES, quantize  # noqa: E402

SOURCE = ROOT / "models" / "stories260K"
OUT = ROOT / "models" / "stories260K-gguf"
FILES = {"stories260K-f32.gguf": T.F32, "stories260K-q8_0.gguf": T.Q8_0}
FILE_TYPES = {T.F32: gguf.LlamaFileType.ALL_F32, T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
ARCHS["Gemma3ForCausalLM"] = "gemma3"
NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 3's norms as llama.cpp names them (its ffn_norm is the pre-feedforward norm)
GEMMA3_NAMES = {
    **NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
GLOBAL["lm_head.weight"] = "output.weight"


def permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K order: within a head, row i of the first half and row i of the second half become
    rows 2i and 2i + 1, the adjacent pair that ggml's RoPE rotates."""
    return (
        rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def gguf_name(name: str, names: dict[str, str] = NAMES) -> str:
    if name in GLOBAL:
        return GLOBAL[name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not match or match[2] not in names:
        raise ValueError(f"tensor {name!r} has no GGUF name here")
    return f"blk.{match[1]}.{names[match[2]]}"


def add_tokenizer(writer: gguf.GGUFWriter, folder: Path) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec["model"]
    if model["type"] != "BPE" or not model.get("byte_fallback"):
        raise ValueError(f"{folder}: only a SentencePiece-style BPE tokenizer.json is converted here")
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    special = {t["id"]: t["content"] for t in spec["added_tokens"] if t.get("special")}
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    ids = {name: vocab.get(config.get(name)) for name in ("bos_token", "eos_token", "unk_token")}
    types = []
    for i, piece in enumerate(tokens):
        if i == ids["unk_token"]:
            types.append(gguf.TokenType.UNKNOWN)
        elif i in special:
            types.append(gguf.TokenType.CONTROL)
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    # SentencePiece BPE scores a piece by when it was learned, -id; its merges are recovered from them
    writer.add_token_scores(
        [0.0 if types[i] != gguf.TokenType.NORMAL else -float(i) for i in range(len(tokens))]
    )
    writer.add_token_types([int(t) for t in types])
    writer.add_bos_token_id(ids["bos_token"])
    writer.add_eos_token_id(ids["eos_token"])
    writer.add_unk_token_id(ids["unk_token"])
    writer.add_add_bos_token(bool(config.get("add_bos_token", True)))
    writer.add_add_eos_token(bool(config.get("add_eos_token", False)))
    writer.add_add_space_prefix(spec["pre_tokenizer"].get("prepend_scheme", "always") != "never")


def default_type(qtype: T, data: np.ndarray) -> T:
    """qtype for 2-D weights whose rows are whole blocks (else F16, as llama.cpp falls back), F32 for 1-D."""
    kind = qtype if data.ndim == 2 else T.F32
    return T.F16 if kind != T.F32 and data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] else kind


def write_gguf(
    folder: Path, out: Path, qtype: T = T.F32, *, tokenizer=True, type_of=None, file_type=None
) -> Path:
    """`folder`'s model as a GGUF file at `out`, each tensor in default_type(qtype, array), or in
    type_of(GGUF name, array) where given (then file_type is the file's general.file_type). tokenizer:
    True for the folder's, False for none, or a function that adds another's to the gguf.GGUFWriter."""
    hp = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    arch = ARCHS[hp["architectures"][0]]
    heads, kv_heads = hp["num_attention_heads"], hp.get("num_key_value_heads") or hp["num_attention_heads"]
    head_dim = hp.get("head_dim") or hp["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(folder.name)
    writer.add_vocab_size(hp["vocab_size"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(ModelConfig.from_pretrained(folder).rope_theta)
    writer.add_layer_norm_rms_eps(float(hp.get("rms_norm_eps", 1e-6)))
    writer.add_file_type(FILE_TYPES[qtype] if file_type is None else file_type)
    scaling = ModelConfig.from_pretrained(folder).rope_scaling  # transformers 4's keys or 5's
    if scaling is not None:
        if scaling.rope_type not in ("linear", "yarn"):
            raise ValueError(f"{folder}: RoPE scaling {scaling.rope_type!r} is not written here")
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling.rope_type))
        writer.add_rope_scaling_factor(scaling.factor)
        if scaling.rope_type == "yarn":
            writer.add_rope_scaling_orig_ctx_len(scaling.original_max_position_embeddings)
    if arch == "gemma3":  # the converter's Gemma3Model: no attention softcap, a window unless pattern is 1
        writer.add_sliding_window(hp["sliding_window"])
        if hp.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
    if callable(tokenizer):
        tokenizer(writer)
    elif tokenizer:
        add_tokenizer(writer, folder)
    names = GEMMA3_NAMES if arch == "gemma3" else NAMES
    for name, tensor in read_checkpoint(folder).items():
        data = np.asarray(tensor, dtype=np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):  # Gemma3RMSNorm's 1 + w, added in float32
            data = data + np.float32(1)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, kv_heads)
        kind = default_type(qtype, data) if type_of is None else type_of(gguf_name(name, names), data)
        blocks = quantize(data, kind.name) if kind.name in TYPES else gguf.quants.quantize(data, kind)
        writer.add_tensor(gguf_name(name, names), blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, qtype in FILES.items():
        path = write_gguf(SOURCE, OUT / name, qtype)
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
