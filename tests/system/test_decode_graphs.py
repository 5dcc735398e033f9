"""Decode steps padded to batch-size buckets (NumPy backend) and replayed as graphs (CUDA emulator) give the
eager path's greedy tokens; a graph that reads an input outside its static buffers is caught."""

import platform

import numpy as np
import pytest

from minisarathi.backends import cuda_ops, emulator
from minisarathi.cli_args import add_engine_arguments, engine_options_from_args
from minisarathi.llm import LLM
from minisarathi.model import decode_graphs
from minisarathi.sampling_params import SamplingParams

emulator_only = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)

# Six requests finishing at different steps: the decode batch shrinks 6 -> 5 -> ... -> 1 across the buckets
# 8, 4, 2 and 1 (and grows again as the late ones start), while every context grows step by step.
PROMPTS = [
    "Once upon a time",
    "The cat sat",
    "Lily and Tom went to the park. They saw",
    "A big dog",
    "Sun",
    "One day a little girl named Sue",
]
MAX_TOKENS = [21, 7, 15, 3, 12, 30]
OPTIONS = dict(max_num_seqs=8, max_model_len=96, block_size=8, chunk_size=16, seed=0)


def generate(device: str, cuda_graphs: bool, **options):
    llm = LLM(device=device, cuda_graphs=cuda_graphs, **OPTIONS, **options)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)], llm


def test_bucket_sizes():
    assert decode_graphs.bucket_sizes(1) == [1]
    assert decode_graphs.bucket_sizes(8) == [1, 2, 4, 8]
    assert decode_graphs.bucket_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert decode_graphs.bucket_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert decode_graphs.bucket_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 96, 128]


def test_padded_buckets_give_the_eager_tokens_on_numpy(monkeypatch):
    sizes = []
    pad = decode_graphs.pad_to_bucket
    monkeypatch.setattr(
        decode_graphs,
        "pad_to_bucket",
        lambda batch, size, *rest: sizes.append((batch.num_seqs, size)) or pad(batch, size, *rest),
    )
    eager, _ = generate("cpu", False)
    assert not sizes
    padded, llm = generate("cpu", True)
    assert padded == eager
    assert {size for _, size in sizes} == {1, 2, 4, 8}  # every bucket used
    assert any(n < size for n, size in sizes)  # with padding rows
    assert llm.engine.model.decode_graphs.buckets == {}  # NumPy: no graph
    assert generate("cpu", True, overlap=True)[0] == eager  # previous ids filled into padded rows


def test_padded_buckets_past_32_give_the_eager_tokens_on_numpy(monkeypatch):
    """40 requests over max_num_seqs 48: the buckets 32 and 48 (the last one is max_num_seqs itself)."""
    sizes = set()
    pad = decode_graphs.pad_to_bucket
    monkeypatch.setattr(
        decode_graphs, "pad_to_bucket", lambda batch, size, *rest: sizes.add(size) or pad(batch, size, *rest)
    )
    prompts = [[1] + [100 + i] * (1 + i % 5) for i in range(40)]
    params = [SamplingParams(max_tokens=4 + i % 9, temperature=0, ignore_eos=True) for i in range(40)]
    tokens = {}
    for cuda_graphs in (False, True):
        llm = LLM(
            device="cpu",
            cuda_graphs=cuda_graphs,
            max_num_seqs=48,
            max_model_len=64,
            block_size=8,
            chunk_size=64,
        )
        tokens[cuda_graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens[True] == tokens[False]
    assert {32, 48} <= sizes


def test_padding_rows_store_nothing_and_attend_to_one_key():
    from minisarathi.batch import make_batch

    tables = np.array([[3, 4], [5, 0]], np.int32)
    batch = make_batch([11, 12], [9, 2], [1, 1], tables, [True, True], 8)
    padded = decode_graphs.pad_to_bucket(batch, 4, 12, 96)
    assert padded.input_ids.tolist() == [11, 12, 0, 0] and padded.positions.tolist() == [9, 2, 0, 0]
    assert padded.slot_mapping.tolist() == batch.slot_mapping.tolist() + [-1, -1]
    assert padded.context_lens.tolist() == [10, 3, 1, 1] and padded.block_tables.shape == (4, 12)
    assert (padded.block_tables[:2, :2] == tables).all() and not padded.block_tables[2:].any()
    assert padded.logits_indices.tolist() == [0, 1, 2, 3] and padded.plan_context_len == 96


def count_replays(monkeypatch) -> list[int]:
    replays = []
    launch = emulator.Graph.launch
    monkeypatch.setattr(
        emulator.Graph, "launch", lambda graph: replays.append(len(graph.launches)) or launch(graph)
    )
    return replays


@emulator_only
def test_graphs_give_the_eager_tokens_on_the_emulator(monkeypatch):
    eager, llm = generate("cuda-emulated", False)
    assert llm.engine.model.decode_graphs is None
    replays = count_replays(monkeypatch)
    graphs, llm = generate("cuda-emulated", True)
    assert graphs == eager
    assert sorted(llm.engine.model.decode_graphs.buckets) == [1, 2, 4, 8]
    assert len(replays) > 20 and min(replays) > 10  # whole forwards replayed, step after step
    # With overlap, a replayed step's input ids are the previous step's, written into the static buffer on
    # the device after the upload.
    replays.clear()
    overlapped, llm = generate("cuda-emulated", True, overlap=True)
    assert overlapped == eager and len(replays) > 20


@emulator_only
def test_every_bucket_is_captured_at_start_up(monkeypatch):
    """No capture mid-serving: the engine captures each bucket, largest first, before its first request."""
    captured = []
    capture = cuda_ops.EmulatorLauncher.capture
    monkeypatch.setattr(
        cuda_ops.EmulatorLauncher, "capture", lambda self, fn: captured.append(self) or capture(self, fn)
    )
    llm = LLM(device="cuda-emulated", **OPTIONS)
    graphs = llm.engine.model.decode_graphs
    assert list(graphs.buckets) == [8, 4, 2, 1] and len(captured) == 4
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    llm.generate(PROMPTS, params)
    assert len(captured) == 4  # serving captured nothing more


@emulator_only
def test_a_capture_that_fails_is_logged_once_and_steps_run_eagerly(monkeypatch, caplog):
    """The matmuls as they were before the backend had a cuBLAS handle of its own: CuPy's wrapper, which
    refuses a capturing stream (emulator/cublas.py). The engine must start, log the failure once, and give
    the eager path's tokens."""
    from minisarathi.backends.emulator import cublas as emulated_cublas

    eager, _ = generate("cuda-emulated", False)
    handle = emulated_cublas.get_cublas_handle()

    def cupy_matmul_t(self, x, w, bias):  # x @ w.T through CuPy's cublas.gemmEx (float32 here)
        out = np.empty((x.shape[0], w.shape[0]), x.dtype)
        scalars = np.array([1.0, 0.0], np.float32)
        emulated_cublas.gemmEx(
            handle,
            1,
            0,
            w.shape[0],
            x.shape[0],
            x.shape[1],
            scalars[:1].ctypes.data,
            w.ctypes.data,
            0,
            x.shape[1],
            x.ctypes.data,
            0,
            x.shape[1],
            scalars[1:].ctypes.data,
            out.ctypes.data,
            0,
            w.shape[0],
            68,
            -1,
        )
        if bias is not None:
            emulator.submit(lambda: np.add(out, bias, out=out))
        return out

    monkeypatch.setattr(cuda_ops.EmulatorLauncher, "matmul_t", cupy_matmul_t)
    freed = []
    monkeypatch.setattr(cuda_ops.EmulatorLauncher, "free_graph_memory", lambda self: freed.append(self))
    with caplog.at_level("WARNING", logger="minisarathi.engine"):
        graphs, llm = generate("cuda-emulated", True)
    failures = [r for r in caplog.records if "capture" in r.getMessage()]
    assert len(failures) == 1 and "NotImplementedError" in failures[0].getMessage()
    assert llm.engine.model.decode_graphs.buckets == {} and freed == [llm.engine.model.ops.launcher]
    assert graphs == eager


@emulator_only
def test_a_graph_input_outside_the_static_buffer_is_read_stale(monkeypatch):
    """Negative control: the step's metadata uploaded into a fresh buffer instead of the bucket's static one;
    the replayed kernels then read the captured step's metadata and the tokens change."""
    expected, llm = generate("cuda-emulated", True)
    ops = llm.engine.model.ops
    upload = ops.upload_batch
    monkeypatch.setattr(ops, "upload_batch", lambda batch, into=None: upload(batch))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    stale = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert stale != expected


@emulator_only
def test_graphs_plan_paged_attention_partitions_for_the_bucket_not_the_capture_step(monkeypatch):
    """The bundled model's decodes go through paged_attention.cu (head_dim 8 is not one decode_attention.cu
    takes). Its partition count was fixed by the contexts of the step a bucket was captured on, so contexts
    that later grew past one partition lost their later keys. Partitions of 16 keys make that happen here."""
    monkeypatch.setattr(cuda_ops, "PA_PARTITION_SIZE", 16)
    eager, _ = generate("cuda-emulated", False)
    graphs, _ = generate("cuda-emulated", True)
    assert graphs == eager


@emulator_only
def test_graphs_own_what_they_read(monkeypatch):
    """A captured graph holds only addresses. On a GPU, an array that only the upload cache held is freed when
    the cache drops it, and its memory goes to the next allocation while replays keep reading it. Here every
    array the cache drops is overwritten as such reuse would; the graphs' tokens must not change."""
    monkeypatch.setattr(cuda_ops, "PA_PARTITION_SIZE", 16)  # the reduce's token list is read as well
    eager, _ = generate("cuda-emulated", False)

    class ReusedOnDrop(dict):
        def clear(self):
            for _, device in self.values():
                if isinstance(device, np.ndarray) and device.base is None:  # its own memory, not a view
                    device.fill(0)
            super().clear()

    make = cuda_ops.CudaOps.__init__

    def init(self, *args, **kwargs):
        make(self, *args, **kwargs)
        self._uploads = ReusedOnDrop()

    monkeypatch.setattr(cuda_ops.CudaOps, "__init__", init)
    graphs, _ = generate("cuda-emulated", True)
    assert graphs == eager


@emulator_only
def test_capture_records_without_running_and_refuses_uploads():
    ops = cuda_ops.emulated()
    x = ops.launcher.to_device(np.ones((2, 8), np.float32))
    w = ops.launcher.to_device(np.eye(8, dtype=np.float32))
    graph, out = ops.launcher.capture(lambda: ops.silu_and_mul(ops.linear(x, w)))
    assert len(graph.launches) == 2
    out[...] = 7.0
    graph.launch()  # computed only by a replay
    np.testing.assert_allclose(out, np.full((2, 4), 1 / (1 + np.exp(-1.0))), rtol=1e-6)
    x[...] = 2.0  # a replay reads the inputs' current values
    graph.launch()
    np.testing.assert_allclose(out, np.full((2, 4), 2 / (1 + np.exp(-2.0)) * 2), rtol=1e-6)
    with pytest.raises(RuntimeError, match="host-to-device copy during a graph capture"):
        ops.launcher.capture(lambda: ops.launcher.to_device(np.zeros(3, np.int32)))
    with pytest.raises(RuntimeError, match="device-to-host copy during a graph capture"):
        ops.launcher.capture(lambda: ops.to_numpy(out))
    assert not emulator.capturing()


def test_no_cuda_graphs_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_options_from_args(parser.parse_args([]))["cuda_graphs"] is None
    assert engine_options_from_args(parser.parse_args(["--no-cuda-graphs"]))["cuda_graphs"] is False
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM(cuda_graphs="yes")


@emulator_only
def test_graphs_through_decode_attention_give_the_eager_tokens():
    """A random bf16 Llama of head_dim 64, whose decodes go through decode_attention.cu: 5 rows in the bucket
    of 8 (3 padding rows), planned once for max_model_len with the same splits in every row, while the eager
    steps plan from each step's lengths. The rows grow past split boundaries (64 and 128 keys) from one key up
    to a long row; greedy tokens equal the eager ones and the logits agree to bf16 tolerance."""
    from minisarathi.config import ModelConfig
    from minisarathi.dtypes import bf16_to_float32
    from minisarathi.model.llama import LlamaModel
    from minisarathi.testing import ScheduledChunk, build_batch

    config = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 256,
            "vocab_size": 300,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
    )
    rng = np.random.default_rng(0)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    weights = {"embed_tokens": w(300, 128), "norm": 1 + w(128), "lm_head": w(300, 128)}
    for i in range(2):
        weights |= {
            f"layers.{i}.input_layernorm": 1 + w(128),
            f"layers.{i}.qkv_proj": w(12 * 64, 128),
            f"layers.{i}.o_proj": w(128, 512),
            f"layers.{i}.post_attention_layernorm": 1 + w(128),
            f"layers.{i}.gate_up_proj": w(512, 128),
            f"layers.{i}.down_proj": w(128, 256),
        }
    model = LlamaModel(config, weights, cuda_ops.emulated("bfloat16"))
    launched, kernel = set(), model.ops.launcher.kernel
    model.ops.launcher.kernel = lambda file, name: launched.add(name.split("<")[0]) or kernel(file, name)
    block_size, steps, start = 16, 4, [0, 61, 125, 1500, 3000]  # cached keys before the first decode
    tables = [list(range(s * 200, s * 200 + 200)) for s in range(len(start))]
    cached_keys = rng.standard_normal((2, 2, 1000, 2, block_size, 64)).astype(np.float32)  # layer, K/V, ...

    def decode(graphs: bool):
        cache = model.new_kv_cache(1000, block_size)
        for layer, (k, v) in enumerate(cache):  # the same history in both runs, as a prefill would leave it
            k[...], v[...] = (model.ops.launcher.to_device(model.ops.weight(x)) for x in cached_keys[layer])
        model.decode_graphs = None
        if graphs:
            model.use_decode_buckets(
                max_num_seqs=8, max_model_len=3200, block_size=block_size, kv_cache=cache
            )
        tokens, logits = [[3] for _ in start], []
        for step in range(steps):
            chunks = [
                ScheduledChunk([t[-1]], n + step, table, True) for t, n, table in zip(tokens, start, tables)
            ]
            out = bf16_to_float32(
                model.ops.launcher.to_host(
                    model.forward(build_batch(chunks, block_size), cache, device_logits=True)
                )
            )
            logits.append(out)
            for t, row in zip(tokens, out):
                t.append(int(row.argmax()))
        return tokens, np.array(logits)

    eager_tokens, eager_logits = decode(False)
    graph_tokens, graph_logits = decode(True)
    assert sorted(model.decode_graphs.buckets) == [1, 2, 4, 8]
    assert {"decode_attention_kernel", "decode_attention_reduce_kernel"} <= launched
    assert graph_tokens == eager_tokens
    np.testing.assert_allclose(graph_logits, eager_logits, rtol=0, atol=0.03 * np.abs(eager_logits).max())


def test_a_failed_capture_reports_its_own_error_and_ends_the_capture():
    """CupyLauncher.capture over a stand-in for CuPy's streams: when fn raises, the capture is ended, and an
    end_capture that fails too (as an invalidated capture's does) does not hide fn's error."""
    import contextlib
    import types

    calls = []

    class Stream:
        def __init__(self, non_blocking):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def begin_capture(self):
            calls.append("begin")

        def end_capture(self):
            calls.append("end")
            raise RuntimeError("cudaErrorStreamCaptureInvalidated")

    class Pool:
        malloc = None

    def refused():
        raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")

    launcher = object.__new__(cuda_ops.CupyLauncher)  # no GPU here: only capture() is exercised
    launcher.xp = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            MemoryPool=Pool, Stream=Stream, using_allocator=lambda malloc: contextlib.nullcontext()
        )
    )
    launcher._graph_pool = None
    with pytest.raises(NotImplementedError, match="during stream capture"):
        launcher.capture(refused)
    assert calls == ["begin", "end"]
