"""NumPy forward-pass speed next to the time its matrix products alone take (random weights, float32 or
quantized; or a checkpoint's).

    python -m bench.forward            # hidden 2048, 16 layers, 32/8 heads, I 5632, vocab 32000 (~3.9 GB RAM)
    python -m bench.forward --small    # a quick run on a small shape
    python -m bench.forward --quant Q4_K   # the linear weights and lm_head in a GGUF type (kquants.TYPES)
    python -m bench.forward --dtype bfloat16   # the matrices kept in 16 bits (bfloat16 or float16)
    python -m bench.forward --weights model.gguf   # a GGUF file or Hugging Face folder, as served

For each case it times the whole forward (best of --repeats) and the same weight matmuls (q/k/v, o,
gate/up, down per layer, lm_head for the sampled rows, through the backend's linear) on inputs of the same
shapes and layouts; the ratio shows
what everything else (attention, norms, RoPE, KV writes, Python) costs. Prints one JSON line per case,
then a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.cpu.process_setup import configure_cpu
from minisarathi.config import ModelConfig
from minisarathi.dtypes import DTYPES
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import CheckpointTensor, load_weights
from minisarathi.quant import kquants
from minisarathi.quant.layouts import GgmlType, from_gguf
from minisarathi.testing import ScheduledChunk, build_batch

SMALL = dict(
    hidden=256,
    layers=4,
    heads=8,
    kv_heads=4,
    intermediate=688,
    vocab=4096,
    prefill_tokens=128,
    decode_batches="1,8",
    context=64,
)


def quantized(w: np.ndarray, qtype: str) -> CheckpointTensor:
    """w[N, K] in GGUF type `qtype` (kquants' quantizers), in its layout as a GGUF file's loads."""
    return CheckpointTensor("quantized", from_gguf("w", GgmlType[qtype], kquants.quantize(w, qtype)))


def random_model(args) -> LlamaModel:
    config = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": args.vocab,
            "hidden_size": args.hidden,
            "intermediate_size": args.intermediate,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads,
            "max_position_embeddings": max(4096, args.prefill_tokens, args.context),
        }
    )
    rng = np.random.default_rng(0)
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * D

    def w(*shape):  # float32, scaled so activations stay O(1)
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[-1] ** -0.5)

    block = 256 if args.quant and args.quant.endswith("_K") else 32

    def linear(*shape):  # the weights linear reads; quantized where a row is whole blocks, as llama.cpp's
        return quantized(w(*shape), args.quant) if args.quant and shape[-1] % block == 0 else w(*shape)

    weights = {
        "embed_tokens": w(config.vocab_size, H),
        "norm": np.ones(H, np.float32),
        "lm_head": linear(config.vocab_size, H),
    }
    for i in range(config.num_hidden_layers):
        weights |= {
            f"layers.{i}.input_layernorm": np.ones(H, np.float32),
            f"layers.{i}.qkv_proj": linear(qkv_rows, H),
            f"layers.{i}.o_proj": linear(H, config.num_attention_heads * D),
            f"layers.{i}.post_attention_layernorm": np.ones(H, np.float32),
            f"layers.{i}.gate_up_proj": linear(2 * I, H),
            f"layers.{i}.down_proj": linear(H, I),
        }
    return LlamaModel(config, weights, CpuOps(args.dtype))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def best_times(fns, repeats: int, clock=time.perf_counter) -> list[float]:
    """Best-of-repeats seconds of each function, run in turns so that load from other processes on a
    shared machine falls on all of them alike. clock "cpu" (the process's CPU time) is steadier on a busy
    machine; with one BLAS thread it counts exactly the work."""
    for fn in fns:
        fn()  # warm-up: page faults, BLAS buffers
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = clock()
            fn()
            best[i] = min(best[i], clock() - start)
    return best


def matmuls_alone(model: LlamaModel, num_tokens: int, num_logits: int):
    """A function doing just the forward's weight matmuls for num_tokens rows, as the forward does them: the
    backend's linear (its choice of product for the row count), each input in the layout the forward hands
    it (the down projection's is what silu_and_mul leaves of the gate/up product: F order after a transposed
    product)."""
    rng = np.random.default_rng(1)
    ops, c = model.ops, model.config
    x = rng.standard_normal((num_tokens, c.hidden_size), dtype=np.float32)
    attn = rng.standard_normal((num_tokens, c.num_attention_heads * c.head_dim), dtype=np.float32)
    act = ops.silu_and_mul(ops.linear(x, model.layers[0].gate_up_proj))  # float32[T, I]
    last = rng.standard_normal((num_logits, c.hidden_size), dtype=np.float32)

    def run():
        for layer in model.layers:
            ops.linear(x, layer.qkv_proj)
            ops.linear(attn, layer.o_proj)
            ops.linear(x, layer.gate_up_proj)
            ops.linear(act, layer.down_proj)
        ops.linear(last, model.lm_head)

    return run


def bench_case(
    model, phase: str, chunks: list[ScheduledChunk], block_size: int, num_blocks: int, repeats: int, clock
) -> dict:
    batch = build_batch(chunks, block_size)
    cache = model.new_kv_cache(num_blocks, block_size)
    forward_s, matmul_s = best_times(
        [
            lambda: model.forward(batch, cache),
            matmuls_alone(model, batch.num_tokens, len(batch.logits_indices)),
        ],
        repeats,
        clock,
    )
    return {
        "bench": "forward",
        "phase": phase,
        "batch": len(chunks),
        "tokens": batch.num_tokens,
        "context": batch.max_context_len,
        "forward_ms": round(forward_s * 1e3, 2),
        "matmul_ms": round(matmul_s * 1e3, 2),
        "ratio": round(forward_s / matmul_s, 3),
        "tokens_per_s": round(batch.num_tokens / forward_s, 1),
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--prefill-tokens", type=int, default=512, help="tokens of the prefill chunk (0: skip)"
    )
    parser.add_argument("--decode-batches", default="1,32", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=256, help="context length of each decoding sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a small shape for a quick run")
    parser.add_argument("--quant", choices=kquants.TYPES, help="linear weights and lm_head in this GGUF type")
    parser.add_argument("--weights", help="a GGUF file or Hugging Face folder instead of random weights")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="CpuOps' weight dtype (16 bits: the matrices)"
    )
    parser.add_argument(
        "--clock", choices=CLOCKS, default="wall", help="wall time, or the process's CPU time"
    )
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=None,
        help="as the engine's option (default: auto); the process is set up as the engine sets it up",
    )
    args = parser.parse_args()
    print(configure_cpu(args.blas_threads).describe(), flush=True)
    if args.small:
        for name, value in SMALL.items():
            setattr(args, name, value)
    if args.weights:
        config = ModelConfig.from_pretrained(args.weights)
        model = LlamaModel(config, load_weights(args.weights, config), CpuOps(args.dtype))
    else:
        model = random_model(args)
    bs = args.block_size
    blocks_per_seq = -(-max(args.prefill_tokens, args.context) // bs)
    batches = [int(b) for b in args.decode_batches.split(",")]
    cases = (
        [("prefill", [ScheduledChunk([5] * args.prefill_tokens, 0, list(range(blocks_per_seq)), True)])]
        if args.prefill_tokens
        else []
    )
    for b in batches:
        cases.append(
            (
                "decode",
                [
                    ScheduledChunk(
                        [5], args.context - 1, list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)), True
                    )
                    for s in range(b)
                ],
            )
        )
    num_blocks = blocks_per_seq * max(batches + [1])
    rows = []
    for phase, chunks in cases:
        row = bench_case(model, phase, chunks, bs, num_blocks, args.repeats, CLOCKS[args.clock])
        print(json.dumps(row), flush=True)
        rows.append(row)
    c = model.config
    print(
        f"\nmodel: hidden {c.hidden_size}, {c.num_hidden_layers} layers, heads {c.num_attention_heads}/"
        f"{c.num_key_value_heads}, intermediate {c.intermediate_size}, vocab {c.vocab_size}, "
        f"{args.weights or (f'{args.quant} linear weights' if args.quant else args.dtype)}; "
        f"block size {bs}; numpy {np.__version__}, {platform.machine()}"
    )
    print(
        f"{'phase':8} {'batch':>5} {'tokens':>6} {'context':>7} {'forward ms':>10} {'matmul ms':>9} "
        f"{'ratio':>6} {'tokens/s':>9}"
    )
    for r in rows:
        print(
            f"{r['phase']:8} {r['batch']:5d} {r['tokens']:6d} {r['context']:7d} {r['forward_ms']:10.2f} "
            f"{r['matmul_ms']:9.2f} {r['ratio']:6.3f} {r['tokens_per_s']:9.1f}"
        )


if __name__ == "__main__":
    main()
