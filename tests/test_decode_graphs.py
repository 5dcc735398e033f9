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

emulator_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only")

# Six requests finishing at different steps: the decode batch shrinks 6 -> 5 -> ... -> 1 across the buckets
# 8, 4, 2 and 1 (and grows again as the late ones start), while every context grows step by step.
PROMPTS = ["Once upon a time", "The cat sat", "Lily and Tom went to the park. They saw", "A big dog", "Sun",
           "One day a little girl named Sue"]
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
    monkeypatch.setattr(decode_graphs, "pad_to_bucket",
                        lambda batch, size, *rest: sizes.append((batch.num_seqs, size)) or pad(batch, size, *rest))
    eager, _ = generate("cpu", False)
    assert not sizes
    padded, llm = generate("cpu", True)
    assert padded == eager
    assert {size for _, size in sizes} == {1, 2, 4, 8}                 # every bucket used
    assert any(n < size for n, size in sizes)                          # with padding rows
    assert llm.engine.model.decode_graphs.buckets == {}                # NumPy: no graph
    assert generate("cpu", True, overlap=True)[0] == eager             # previous ids filled into padded rows


def test_padded_buckets_past_32_give_the_eager_tokens_on_numpy(monkeypatch):
    """40 requests over max_num_seqs 48: the buckets 32 and 48 (the last one is max_num_seqs itself)."""
    sizes = set()
    pad = decode_graphs.pad_to_bucket
    monkeypatch.setattr(decode_graphs, "pad_to_bucket", lambda batch, size, *rest: sizes.add(size) or pad(batch, size, *rest))
    prompts = [[1] + [100 + i] * (1 + i % 5) for i in range(40)]
    params = [SamplingParams(max_tokens=4 + i % 9, temperature=0, ignore_eos=True) for i in range(40)]
    tokens = {}
    for cuda_graphs in (False, True):
        llm = LLM(device="cpu", cuda_graphs=cuda_graphs, max_num_seqs=48, max_model_len=64, block_size=8, chunk_size=64)
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
    monkeypatch.setattr(emulator.Graph, "launch", lambda graph: replays.append(len(graph.launches)) or launch(graph))
    return replays


@emulator_only
def test_graphs_give_the_eager_tokens_on_the_emulator(monkeypatch):
    eager, llm = generate("cuda-emulated", False)
    assert llm.engine.model.decode_graphs is None
    replays = count_replays(monkeypatch)
    graphs, llm = generate("cuda-emulated", True)
    assert graphs == eager
    assert sorted(llm.engine.model.decode_graphs.buckets) == [1, 2, 4, 8]
    assert len(replays) > 20 and min(replays) > 10                     # whole forwards replayed, step after step
    # With overlap, a replayed step's input ids are the previous step's, written into the static buffer on
    # the device after the upload.
    replays.clear()
    overlapped, llm = generate("cuda-emulated", True, overlap=True)
    assert overlapped == eager and len(replays) > 20


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
    takes). Its partition count was fixed by the contexts of the step a bucket was captured on, so contexts that
    later grew past one partition lost their later keys. Partitions of 16 keys make that happen here."""
    monkeypatch.setattr(cuda_ops, "PA_PARTITION_SIZE", 16)
    eager, _ = generate("cuda-emulated", False)
    graphs, _ = generate("cuda-emulated", True)
    assert graphs == eager


@emulator_only
def test_graphs_own_what_they_read(monkeypatch):
    """A captured graph holds only addresses. On a GPU, an array that only the upload cache held is freed when
    the cache drops it, and its memory goes to the next allocation while replays keep reading it. Here every
    array the cache drops is overwritten as such reuse would; the graphs' tokens must not change."""
    monkeypatch.setattr(cuda_ops, "PA_PARTITION_SIZE", 16)   # the reduce's token list is read as well
    eager, _ = generate("cuda-emulated", False)

    class ReusedOnDrop(dict):
        def clear(self):
            for _, device in self.values():
                if isinstance(device, np.ndarray) and device.base is None:   # its own memory, not a view
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
    graph.launch()                                                     # computed only by a replay
    np.testing.assert_allclose(out, np.full((2, 4), 1 / (1 + np.exp(-1.0))), rtol=1e-6)
    x[...] = 2.0                                                       # a replay reads the inputs' current values
    graph.launch()
    np.testing.assert_allclose(out, np.full((2, 4), 2 / (1 + np.exp(-2.0)) * 2), rtol=1e-6)
    with pytest.raises(RuntimeError, match="during a graph capture"):
        ops.launcher.capture(lambda: ops.launcher.to_device(np.zeros(3, np.int32)))
    assert not emulator.capturing()


def test_no_cuda_graphs_flag():
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_options_from_args(parser.parse_args([]))["cuda_graphs"] is None
    assert engine_options_from_args(parser.parse_args(["--no-cuda-graphs"]))["cuda_graphs"] is False
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM(cuda_graphs="yes")
