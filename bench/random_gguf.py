"""A random-weight Llama of a real model's shape as a GGUF file, for side-by-side speed runs on one file:
F16 (llama.cpp's llama-quantize then makes its Q8_0 / Q4_K_M copies), or quantized here by
minisarathi.quant.kquants (--type Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, or Q4_K_M's mix: Q6_K for output.weight
and the attn_v / ffn_down of llama.cpp's use_more_bits layers, Q4_K elsewhere) where llama-quantize is not
at hand. The tokenizer metadata is copied from a vocabulary GGUF file, e.g. llama.cpp's
models/ggml-vocab-llama-spm.gguf (Llama 2's 32,000 pieces, which TinyLlama-1.1B uses).

    python -m bench.random_gguf --vocab PEERS/llama.cpp/models/ggml-vocab-llama-spm.gguf \\
        --out tinyllama-f16.gguf
    PEERS/llama.cpp/build/bin/llama-quantize tinyllama-f16.gguf tinyllama-Q4_K_M.gguf Q4_K_M
    python -m bench.random_gguf --vocab ... --type Q4_K_M --out tinyllama-q4_k_m.gguf

Default shape: TinyLlama-1.1B (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads). Weights are
normal with std 0.02, norms 1: speed does not depend on the values, and the logits stay finite.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from minisarathi.quant import kquants

FILE_TYPES = {
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down Q4_K_M stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(file_type: str, name: str, layer: int | None, layers: int) -> str:
    """A matrix's type in a file of `file_type`."""
    if file_type != "Q4_K_M":
        return file_type
    more = layer is not None and name in ("attn_v", "ffn_down") and use_more_bits(layer, layers)
    return "Q6_K" if name == "output" or more else "Q4_K"


def copy_tokenizer(writer: gguf.GGUFWriter, vocab: Path) -> int:
    """Every tokenizer.* key of `vocab` into `writer`; the number of tokens."""
    reader = gguf.GGUFReader(str(vocab))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    return len(reader.fields["tokenizer.ggml.tokens"].contents())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", required=True, help="a GGUF file whose tokenizer.* metadata is copied")
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--type", choices=FILE_TYPES, default="F16", help="the matrices' GGUF type")
    args = parser.parse_args()
    head_dim = args.hidden // args.heads
    writer = gguf.GGUFWriter(args.out, "llama")
    writer.add_name(Path(args.out).stem)
    vocab_size = copy_tokenizer(writer, Path(args.vocab))
    writer.add_vocab_size(vocab_size)
    writer.add_context_length(args.context)
    writer.add_embedding_length(args.hidden)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(args.intermediate)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(FILE_TYPES[args.type])
    rng = np.random.default_rng(args.seed)

    def add_matrix(name: str, rows: int, cols: int, layer: int | None = None) -> None:
        weights = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
        kind = tensor_type(args.type, name, layer, args.layers)
        full = name if layer is None else f"blk.{layer}.{name}"
        if kind == "F16":
            writer.add_tensor(f"{full}.weight", weights.astype(np.float16))
        else:
            blocks = kquants.quantize(weights, kind)  # uint8[rows, bytes per row]
            writer.add_tensor(f"{full}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[kind])

    ones = np.ones(args.hidden, dtype=np.float32)
    add_matrix("token_embd", vocab_size, args.hidden)
    for i in range(args.layers):
        kv = args.kv_heads * head_dim
        shapes = {
            "attn_q": (args.hidden, args.hidden),
            "attn_k": (kv, args.hidden),
            "attn_v": (kv, args.hidden),
            "attn_output": (args.hidden, args.hidden),
            "ffn_gate": (args.intermediate, args.hidden),
            "ffn_up": (args.intermediate, args.hidden),
            "ffn_down": (args.hidden, args.intermediate),
        }
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for name, shape in shapes.items():
            add_matrix(name, *shape, layer=i)
    writer.add_tensor("output_norm.weight", ones)
    add_matrix("output", vocab_size, args.hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {Path(args.out).stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
