"""A random-weight Llama of a real model's shape as an F16 GGUF file, for side-by-side speed runs on one file
(llama.cpp's llama-quantize then makes its Q8_0 / Q4_K_M copies). The tokenizer metadata is copied from a
vocabulary GGUF file, e.g. llama.cpp's models/ggml-vocab-llama-spm.gguf (Llama 2's 32,000 pieces, which
TinyLlama-1.1B uses).

    python -m bench.random_gguf --vocab PEERS/llama.cpp/models/ggml-vocab-llama-spm.gguf \\
        --out tinyllama-f16.gguf
    PEERS/llama.cpp/build/bin/llama-quantize tinyllama-f16.gguf tinyllama-Q4_K_M.gguf Q4_K_M

Default shape: TinyLlama-1.1B (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads). Weights are
normal with std 0.02, norms 1: speed does not depend on the values, and the logits stay finite.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np


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
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(args.seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(args.hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", matrix(vocab_size, args.hidden))
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
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(*shape))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", matrix(vocab_size, args.hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {Path(args.out).stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
