"""A small random Llama whose matrices have 256-multiple rows, so that every K-quant type holds them, as a
float32 Hugging Face folder and as GGUF files: one per type (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) and one in
llama.cpp's Q4_K_M mix (Q4_K; Q6_K for output and for attn_v / ffn_down of the layers use_more_bits picks).
Hidden 256, intermediate 768, 2 layers, 4 query and 2 key-value heads of 64, the stories260K vocabulary
and tokenizer (512 tokens); the Q5_K file ties lm_head to the embedding table. Seeded: every run writes
the same bytes. Tests write the files into a temporary folder.

    python tests/golden/make_kquant_gguf.py OUT_DIR
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "models" / "stories260K"
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
# file name -> its types: one type for every matrix, or "Q4_K_M"
FILES = {f"kquant-{t.lower()}.gguf": t for t in ("Q4_K_M", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")}
TIED = "Q5_K"  # the file whose lm_head is the embedding table
FILE_TYPES = {
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
}

_spec = importlib.util.spec_from_file_location("make_gguf", Path(__file__).with_name("make_gguf.py"))
make_gguf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_gguf)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down Q4_K_M stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m(name: str) -> T:
    """A tensor's type in the Q4_K_M mix (matrices only)."""
    match = re.fullmatch(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight", name)
    if name == "output.weight" or (match and use_more_bits(int(match[1]), CONFIG["num_hidden_layers"])):
        return T.Q6_K
    return T.Q4_K


def random_folder(out: Path, tied: bool) -> Path:
    """The random model as a float32 Hugging Face folder (config, safetensors, stories260K's tokenizer)."""
    c = dict(CONFIG, tie_word_embeddings=tied)
    H, I, D, layers = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["num_hidden_layers"]
    q_rows, kv_rows = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    rng = np.random.default_rng(260)

    def matrix(rows: int, cols: int) -> np.ndarray:  # float32[rows, cols], activations stay O(1)
        return (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32)

    def norm() -> np.ndarray:  # float32[H]
        return (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": rng.standard_normal((c["vocab_size"], H)).astype(np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm()
        for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            tensors[p + f"self_attn.{name}_proj.weight"] = matrix(rows, H)
        tensors[p + "self_attn.o_proj.weight"] = matrix(H, q_rows)
        tensors[p + "post_attention_layernorm.weight"] = norm()
        tensors[p + "mlp.gate_proj.weight"] = matrix(I, H)
        tensors[p + "mlp.up_proj.weight"] = matrix(I, H)
        tensors[p + "mlp.down_proj.weight"] = matrix(H, I)
    tensors["model.norm.weight"] = norm()
    if not tied:
        tensors["lm_head.weight"] = matrix(c["vocab_size"], H)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(TOKENIZER / name, out / name)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def write(out_dir: Path, name: str) -> Path:
    """FILES[name] written into out_dir (with the float32 folder it is made from)."""
    types = FILES[name]
    tied = types == TIED
    folder = random_folder(Path(out_dir) / ("kquant-f32-tied" if tied else "kquant-f32"), tied)

    def type_of(gguf_name: str, data: np.ndarray) -> T:
        if data.ndim == 1:
            return T.F32
        return q4_k_m(gguf_name) if types == "Q4_K_M" else T[types]

    return make_gguf.write_gguf(folder, Path(out_dir) / name, type_of=type_of, file_type=FILE_TYPES[types])


def main() -> None:
    out = Path(sys.argv[1])
    for name in FILES:
        path = write(out, name)
        print(f"{path}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
