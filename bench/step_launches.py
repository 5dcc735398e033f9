"""Kernel launches per model step on the CUDA backend, and the Python host time it takes to issue them.

    python -m bench.step_launches            # JSON lines, then a table

Launches (custom kernels + cuBLAS calls, CudaOps.launches) are counted while a small random-weight Llama with
Llama-3-8B's head shape (head_dim 128, GQA 4) runs in bfloat16 on the CPU emulator: the count depends only on
the model's structure, its dtype and the batch, not on the device or the widths. It is
`fixed + layers * per_layer`; running the same step with the first layer only separates the two, and the
last column extrapolates to a 32-layer (Llama-3-8B-shaped) model.

Host time: the same wrappers over a launcher that launches nothing (kernels are no-ops, matmuls return empty
arrays), so what is timed is the Python that issues a step: argument checks, metadata caching, array
allocation. CuPy's own cost per launch (argument packing, the driver call) comes on top on a GPU.

The "graph" rows run the decode steps as the engine does with CUDA graphs on (minisarathi/model/decode_graphs.py):
every bucket's graph is captured first, and the step measured replays one: one graph launch, the one copy
of the step's metadata into the bucket's static buffer, and the sampler's launches and uploads.
"""
from __future__ import annotations

import json
import time

import numpy as np

from minisarathi.backends import cuda_ops
from minisarathi.config import ModelConfig
from minisarathi.model.llama import LlamaModel
from minisarathi.sampling_params import SamplingParams
from minisarathi.testing import ScheduledChunk, build_batch

BLOCK_SIZE = 16
MAX_MODEL_LEN = 128   # of the graph rows' buckets: the cases' contexts (100) fit


class NullLauncher(cuda_ops.EmulatorLauncher):
    """Launches nothing: every kernel is a no-op and a matmul returns an uninitialized array of its shape."""

    def kernel(self, file: str, name: str):
        return lambda grid, block, args, shared_mem=0: None

    def matmul_t(self, x, w, bias):
        return np.empty((x.shape[0], w.shape[0]), dtype=x.dtype)


def cases() -> dict[str, list[ScheduledChunk]]:
    """Step shapes: decodes only, one prefill chunk, and a Sarathi hybrid step (a chunk plus decodes)."""
    decode = lambda s, ctx: ScheduledChunk([5], ctx - 1, list(range(s * 8, s * 8 + 8)), True)   # noqa: E731
    return {"decode bs=1": [decode(0, 100)], "decode bs=8": [decode(s, 100) for s in range(8)],
            "prefill 64": [ScheduledChunk([5] * 64, 0, list(range(64, 68)), True)],
            "hybrid 32 + 7 decodes": [ScheduledChunk([5] * 32, 0, list(range(64, 68)), True)]
            + [decode(s, 100) for s in range(7)]}


def use_graphs(model: LlamaModel, graphs: bool, cache: list | None = None) -> None:
    """Decode steps as the engine runs them with CUDA graphs on (a fresh capture per call), or eagerly."""
    model.decode_graphs = None
    if graphs:
        model.use_decode_buckets(max_num_seqs=8, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, kv_cache=cache)


def count(model: LlamaModel, chunks: list[ScheduledChunk], layers: int, graphs: bool = False) -> tuple[int, int]:
    """(launches, host-to-device copies) of one forward with the model cut to its first `layers` layers, plus
    the sampler's. With graphs, of a step that replays its bucket's graph (a graph launch counts as one)."""
    full, launcher = model.layers, model.ops.launcher
    model.layers = full[:layers]
    cache = model.new_kv_cache(72, BLOCK_SIZE)
    use_graphs(model, graphs, cache)
    if graphs:
        for bucket in model.decode_graphs.buckets.values():
            bucket.graph = CountedGraph(bucket.graph, model.ops)
    copies = []
    launcher.to_device = lambda array: copies.append(1) or type(launcher).to_device(launcher, array)
    launcher.copy_to_device = lambda device, array: copies.append(1) or type(launcher).copy_to_device(
        launcher, device, array)
    try:
        model.ops.launches = 0   # counted by CudaOps._kernel and _plain_kernel, one per launch, and linear
        logits = model.forward(build_batch(chunks, BLOCK_SIZE), cache, device_logits=True)
        sampler = model.new_sampler()
        n = len(chunks)
        sampler.sample(logits, [SamplingParams(temperature=0.8, top_k=40, top_p=0.9)] * n, [None] * n,
                       [[1]] * n, [[]] * n)
        return model.ops.launches, len(copies)
    finally:
        model.layers = full
        del launcher.to_device, launcher.copy_to_device
        use_graphs(model, False)


class CountedGraph:
    """A graph whose launches count in CudaOps.launches, as one launch each."""

    def __init__(self, graph, ops):
        self.graph, self.ops = graph, ops

    def launch(self) -> None:
        self.ops.launches += 1
        self.graph.launch()


def host_seconds(model: LlamaModel, chunks: list[ScheduledChunk], graphs: bool = False, repeat: int = 200) -> float:
    """Median seconds of one forward on the null launcher (a fresh batch each time, as a step has); with graphs,
    of the replays of the bucket's graph."""
    cache = model.new_kv_cache(72, BLOCK_SIZE)
    use_graphs(model, graphs, cache)
    model.forward(build_batch(chunks, BLOCK_SIZE), cache, device_logits=True)
    times = []
    for _ in range(repeat):
        batch = build_batch(chunks, BLOCK_SIZE)
        start = time.perf_counter()
        model.forward(batch, cache, device_logits=True)
        times.append(time.perf_counter() - start)
    use_graphs(model, False)
    return float(np.median(times))


SMALL_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 3,
               "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128, "intermediate_size": 768,
               "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def small_llama(ops) -> LlamaModel:
    """Random float32 weights in HF's layout (fused q/k/v and gate/up, as the loader returns them)."""
    config = ModelConfig.from_dict(SMALL_LLAMA)
    rng = np.random.default_rng(0)
    H, I, V, D = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * D
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)   # noqa: E731
    weights = {"embed_tokens": w(V, H), "norm": 1 + w(H), "lm_head": w(V, H)}
    for i in range(config.num_hidden_layers):
        weights |= {f"layers.{i}.input_layernorm": 1 + w(H), f"layers.{i}.qkv_proj": w(qkv, H),
                    f"layers.{i}.o_proj": w(H, config.num_attention_heads * D),
                    f"layers.{i}.post_attention_layernorm": 1 + w(H), f"layers.{i}.gate_up_proj": w(2 * I, H),
                    f"layers.{i}.down_proj": w(H, I)}
    return LlamaModel(config, weights, ops)


def main() -> None:
    emulated = small_llama(cuda_ops.emulated("bfloat16"))
    null = small_llama(cuda_ops.CudaOps(NullLauncher(), "bfloat16"))
    L = emulated.config.num_hidden_layers
    rows = []
    steps = [(name, chunks, False) for name, chunks in cases().items()]
    steps += [(f"{name} graph", chunks, True) for name, chunks in cases().items() if name.startswith("decode")]
    for name, chunks, graphs in steps:
        (one, _), (all_layers, copies) = count(emulated, chunks, 1, graphs), count(emulated, chunks, L, graphs)
        per_layer = (all_layers - one) / (L - 1)
        fixed = all_layers - L * per_layer
        host = host_seconds(null, chunks, graphs)
        row = {"step": name, "launches": all_layers, "per_layer": per_layer, "fixed": fixed,
               "launches_32_layers": fixed + 32 * per_layer, "uploads": copies, "host_us": host * 1e6,
               "host_us_per_layer": host * 1e6 / L}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'step':24s} {'launches':>8s} {'per layer':>9s} {'fixed':>5s} {'at 32 layers':>12s} {'uploads':>7s} "
          f"{'host us':>8s} {'host us/layer':>13s}")
    for r in rows:
        print(f"{r['step']:24s} {r['launches']:8d} {r['per_layer']:9.1f} {r['fixed']:5.0f} {r['launches_32_layers']:12.0f} "
              f"{r['uploads']:7d} {r['host_us']:8.0f} {r['host_us_per_layer']:13.1f}")

if __name__ == "__main__":
    main()
