"""Decode-only steps padded to batch-size buckets, and on the CUDA backends replayed as CUDA graphs.

A decode step's launches are the same from step to step except for the batch's metadata (token ids,
positions, slots, context lengths, block tables), once each step is padded to a bucket: padding rows
decode token 0 at position 0 with context length 1 over block 0 and store nothing (slot -1), and the
block tables are as wide as max_model_len allows. Decode attention is planned once per bucket, with the
same number of splits in every row, and each split's keys are cut from the row's length on the device
(cuda/decode_attention.cu). So one bucket's run can be
captured once and replayed: the step copies its metadata into the bucket's static device buffer (one
upload) and launches the graph. Logits come back for every bucket row; the real rows are the first ones.

Every bucket is captured when the engine starts, largest first, as vLLM does: a capture mid-serving would
show as a TBT spike. A bucket's step runs once eagerly before its capture (kernel compiles, attention plans
and memory-pool growth cannot happen inside one), on padding rows only. If a capture fails, the failure is
logged once and decode steps run eagerly from then on; serving goes on. Steps with prefill tokens always run
eagerly: their token count and attention plan change with every chunk.
On the NumPy backend (no graphs) the padded path runs eagerly; tests hold it to the unpadded one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from minisarathi.batch import Batch

SMALL_BUCKETS = (1, 2, 4, 8, 16)
BUCKET_STEP = 32  # then multiples of 32 up to max_num_seqs

log = logging.getLogger("minisarathi.engine")


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 64, ... and max_num_seqs itself as the last (a running batch never exceeds it)."""
    return (
        [b for b in SMALL_BUCKETS if b < max_num_seqs]
        + list(range(BUCKET_STEP, max_num_seqs, BUCKET_STEP))
        + [max_num_seqs]
    )


@dataclass
class BucketBatch(Batch):
    """A bucket's decode batch. Decode attention is planned once for rows of up to plan_context_len keys (the
    block tables' capacity) and cuts each row's keys on the device from its length (CudaOps reads it).
    It always carries the overlap's index arrays (engine/overlap.py's OverlapBatch), zeros when no row takes
    the previous step's ids, so that the bucket's packed metadata keeps one size (CudaOps.upload_batch)."""

    plan_context_len: int = 0
    previous_ids: Any = None  # the previous step's sampled ids (device); None: none
    previous_rows: np.ndarray | None = None  # int32[bucket]
    previous_sources: np.ndarray | None = None  # int32[bucket]


def pad_to_bucket(batch: Batch, size: int, table_width: int, plan_context_len: int) -> BucketBatch:
    """A decode-only batch as `size` rows over block tables `table_width` wide (see the module's docstring).
    With overlap, the rows that take the previous step's ids on the device keep them; their index arrays are
    padded to `size` entries by repeating the first (the same id written twice)."""

    def padded(array: np.ndarray, fill: int, length: int = size) -> np.ndarray:  # int32[length]
        return np.concatenate([array, np.full(length - len(array), fill, np.int32)])

    tables = np.zeros((size, table_width), np.int32)  # int32[size, table_width]
    tables[: batch.num_seqs, : batch.block_tables.shape[1]] = batch.block_tables
    rows = np.arange(size + 1, dtype=np.int32)  # one token per row
    previous_ids = getattr(batch, "previous_ids", None)
    if previous_ids is None:
        previous_rows = previous_sources = np.zeros(size, np.int32)
    else:
        previous_rows = padded(batch.previous_rows, batch.previous_rows[0])
        previous_sources = padded(batch.previous_sources, batch.previous_sources[0])
    return BucketBatch(
        padded(batch.input_ids, 0),
        padded(batch.positions, 0),
        padded(batch.slot_mapping, -1),
        rows,
        padded(batch.context_lens, 1),
        tables,
        rows[:-1],
        max_query_len=1,
        max_context_len=batch.max_context_len,
        plan_context_len=plan_context_len,
        previous_ids=previous_ids,
        previous_rows=previous_rows,
        previous_sources=previous_sources,
    )


@dataclass
class CapturedBucket:
    metadata: Any  # the static int32 device buffer the graph's kernels read (CudaOps.upload_batch)
    graph: Any  # launch() replays the bucket's run
    logits: Any  # [bucket, vocab] on the device: the graph writes them here at every replay
    final_hidden: Any  # [bucket, H]: the rows after the final norm (model.final_hidden), written alike


class DecodeGraphs:
    """Runs a model's decode-only steps padded to buckets; with a KV cache, as one CUDA graph per bucket over
    it."""

    def __init__(
        self, model, max_num_seqs: int, max_model_len: int, block_size: int, kv_cache: list | None = None
    ):
        self.model = model  # a LlamaModel: ops, run()
        self.sizes = bucket_sizes(max_num_seqs)
        self.table_width = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.buckets: dict[int, CapturedBucket] = {}
        self.kv_cache = kv_cache  # the cache the graphs read and write; None: padded eager steps, no graphs
        if kv_cache is not None:
            self._capture_all()

    def _capture_all(self) -> None:
        empty = np.zeros(0, np.int32)
        no_rows = Batch(
            empty,
            empty,
            empty,
            np.zeros(1, np.int32),
            empty,
            np.zeros((0, 1), np.int32),
            empty,
            max_query_len=1,
            max_context_len=1,
        )
        ops = self.model.ops
        for size in reversed(self.sizes):  # largest first: the smaller graphs then fit in the pool's memory
            padded = pad_to_bucket(no_rows, size, self.table_width, self.max_model_len)
            try:
                metadata = ops.upload_batch(padded)
                self.model.run(padded, self.kv_cache)
                graph, logits = ops.launcher.capture(lambda: self.model.run(padded, self.kv_cache))
            except Exception as exc:  # whatever refuses a capture on this GPU, serving goes on without graphs
                log.warning(
                    "CUDA graph capture of the decode bucket of %d rows failed (%s: %s); decode steps run "
                    "eagerly",
                    size,
                    type(exc).__name__,
                    exc,
                )
                self.buckets.clear()
                ops.launcher.free_graph_memory()
                self.kv_cache = None
                return
            self.buckets[size] = CapturedBucket(metadata, graph, logits, self.model.final_hidden)

    def takes(self, batch: Batch) -> bool:
        """Decode-only (one token per sequence, every row sampled) and no larger than the largest bucket."""
        return (
            batch.max_query_len == 1
            and batch.num_tokens == batch.num_seqs == len(batch.logits_indices)
            and batch.num_seqs <= self.sizes[-1]
            and batch.block_tables.shape[1] <= self.table_width
        )

    def forward(self, batch: Batch, kv_cache: list) -> Any:
        """Logits [num_seqs, vocab] on the device, in the backend's dtype, as LlamaModel.run returns them."""
        size = next(s for s in self.sizes if s >= batch.num_seqs)
        padded = pad_to_bucket(batch, size, self.table_width, self.max_model_len)
        ops, bucket = self.model.ops, self.buckets.get(size)
        if bucket is None:
            ops.upload_batch(padded)
            logits = self.model.run(padded, kv_cache)
        else:
            if kv_cache is not self.kv_cache:
                raise ValueError("kv_cache: the decode graphs were captured over another KV cache")
            ops.upload_batch(padded, into=bucket.metadata)
            bucket.graph.launch()
            logits, self.model.final_hidden = bucket.logits, bucket.final_hidden
        return logits[: batch.num_seqs]
