"""The CPU backend's decode attention as native code: native_attention.cpp, compiled at first use, via ctypes.

The decodes of a batch (single-token runs) attend to the paged KV cache read in place, through their block
tables, in one call per layer; prefill chunks keep NumPy's tiled attention (attention.py), which also stays
the decode path where the kernel does not run. Built and loaded like the packed matmul (packed_gemm.py,
through native.py): an AVX-512 and an AVX2 + FMA path, the widest this CPU runs chosen at load, and a C++
compiler (CXX, default g++) the first time; the library is cached by content. Where the CPU has neither, no
compiler, or MINISARATHI_CPU_ATTENTION=0 is set (to measure against NumPy), `kernel()` is None and decodes
run on NumPy.

Where it runs, every model's decodes use it (`runs`): it reads the cache in place, so the caches get none of
the kept decode K/V memory NumPy's path needs at long contexts (attention.kept_memory: 264 MiB on a 22-layer
model), and it is faster than NumPy's path at every shape measured (docs/cpu_performance.md).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np

from minisarathi.backends.cpu.native import AVX2, cpu_library_path, load_cpu_library
from minisarathi.backends.cpu.process_setup import kernel_threads
from minisarathi.batch import Batch

SOURCE = Path(__file__).resolve().parent / "native_attention.cpp"
# No -ffast-math: every sum keeps its written order (a row's result must not depend on its batch).
# No -mavx512f: each path has its target attribute and is chosen at run time.
FLAGS = ["-std=c++17", "-O3", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wl,-z,defs", "-fopenmp"]

ISAS = {"avx2": 2, "avx512": 3}  # the kernel's enum Isa

log = logging.getLogger(__name__)


class DecodeRows:
    """What the kernel reads besides q, the caches and out: a batch's decodes and the cache's shape, laid out
    as the kernel's DecodeBatch (int64 fields) once per batch (AttentionPlan) and shared by its layers, so
    that a layer's call passes 7 arguments and reads 2 addresses (.ctypes.data is slow)."""

    def __init__(
        self, batch: Batch, decodes: np.ndarray, cache_shape: tuple[int, int, int, int], query_heads: int
    ):
        """decodes: the sequences it runs, single tokens or short runs (speculation's verification chunks),
        whose query j is a decode over the keys up to its own position."""
        num_blocks, Hk, block_size, D = cache_shape
        q_lens = np.diff(batch.query_start)[decodes]
        if (q_lens == 1).all():
            self.seqs = decodes.astype(np.int64)  # int64[S]: decode sequences
            self.rows = batch.query_start[decodes].astype(np.int64)  # int64[S]: their token rows
            tables, context_lens = batch.block_tables, batch.context_lens
        else:  # one entry per query, as a sequence of its own: its run's table, its own context
            entry = np.repeat(decodes, q_lens)  # int[E]: each query's sequence
            after = np.repeat(np.cumsum(q_lens), q_lens) - np.arange(1, len(entry) + 1)  # queries after it
            self.rows = (batch.query_start[entry + 1] - 1 - after).astype(np.int64)  # int64[E]
            tables, context_lens = batch.block_tables[entry], batch.context_lens[entry] - after
            self.seqs = np.arange(len(entry), dtype=np.int64)
        self.block_tables = np.ascontiguousarray(tables, dtype=np.int32)  # int32[num_seqs or E, B]
        self.context_lens = np.ascontiguousarray(context_lens, dtype=np.int32)  # int32[num_seqs or E]
        self.fields = np.array(
            [
                self.block_tables.ctypes.data,
                self.block_tables.shape[1],
                self.context_lens.ctypes.data,
                self.seqs.ctypes.data,
                self.rows.ctypes.data,
                len(self.seqs),
                num_blocks,
                Hk,
                query_heads // Hk,
                D,
                block_size,
            ],
            np.int64,
        )  # DecodeBatch
        self.address = self.fields.ctypes.data
        self.query_shape = (query_heads, D)
        self.head_strides = (D * 4, 4)  # of q's rows as the kernel reads them: [Hq, D] contiguous


class CpuAttention:
    """The loaded library's path `isa` ("avx512" or "avx2"; None: the widest this CPU runs)."""

    def __init__(self, lib: ctypes.CDLL, isa: str | None = None):
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        lib.decode_attention.argtypes = [i32, ptr, ptr, i64, ptr, ptr, ctypes.c_float, i64, i32, ptr]
        lib.decode_attention.restype = i32
        lib.exp_nonpositive_of.argtypes = [i32, ptr, i64, ptr]
        lib.exp_nonpositive_of.restype = i32
        best = lib.native_attention_best_isa()
        if isa is None:
            isa = {v: k for k, v in ISAS.items()}[best]
        elif ISAS[isa] > best:
            raise ValueError(f"native attention: this CPU cannot run the {isa} path")
        self.lib, self.isa, self._code = lib, isa, ISAS[isa]
        self._call = lib.decode_attention

    def exp(self, x: np.ndarray) -> np.ndarray:
        """float32 e^x for x <= 0 as the kernel computes it (for tests of its accuracy)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        self.lib.exp_nonpositive_of(self._code, x.ctypes.data, x.size, out.ctypes.data)
        return out

    def decode(
        self,
        q: np.ndarray,
        cache_addresses: tuple[int, int],
        decodes: DecodeRows,
        scale: float,
        out: np.ndarray,
        window: int | None = None,
        threads: int | None = None,
    ) -> None:
        """Writes the decodes' rows of out (float32[T, Hq, D], C order) from q (float32[T, Hq, D]).
        cache_addresses: the data of the caches (C order, of the shape `decodes` was made for). window: a
        sliding window, each decode attending to its last `window` keys only. threads: None, kernel_threads()
        (the result is the same for any count)."""
        if q.dtype != np.float32 or out.dtype != np.float32:
            raise TypeError(f"decode attention: q and out must be float32, got {q.dtype} and {out.dtype}")
        if q.shape[1:] != decodes.query_shape:
            raise ValueError(f"q: {q.shape[1:]} heads x head_dim, the plan is for {decodes.query_shape}")
        if q.strides[1:] != decodes.head_strides:
            q = np.ascontiguousarray(q)
        status = self._call(
            self._code,
            decodes.address,
            q.ctypes.data,
            q.strides[0] // 4,
            *cache_addresses,
            scale,
            window or 0,
            kernel_threads() if threads is None else threads,
            out.ctypes.data,
        )
        if status == -1:
            raise MemoryError(f"decode attention: no memory for the scores of {len(decodes.seqs)} decodes")
        if status == -3:
            raise ValueError(f"native attention: this CPU cannot run the {self.isa} path")
        if status:
            raise IndexError(
                f"decode attention: a block table names a block outside the cache's "
                f"{decodes.fields[6]}, or a context is longer than its block-table row"
            )


def runs() -> bool:
    """Whether decodes use the kernel: wherever it runs here, for every model (the rule is per machine, never
    per batch: its results differ from NumPy's in the last bits, and a row's output must not depend on its
    batch)."""
    return kernel() is not None


def library_path() -> Path:
    """native_attention.cpp built for this CPU (cached); RuntimeError or OSError where it cannot be."""
    return cpu_library_path(SOURCE, FLAGS, "the native decode attention")


@functools.cache
def kernel() -> CpuAttention | None:
    """The library for this CPU, built at first use; None where it cannot run here (the log says why). Called
    with the GIL held: a call takes a few us on small models, and releasing the GIL around it could hand it to
    the server's event loop and hold the engine up."""
    lib = load_cpu_library(
        SOURCE,
        FLAGS,
        "native decode attention",
        "MINISARATHI_CPU_ATTENTION",
        needs=AVX2,
        hold_gil=True,
        log=log,
    )
    if lib is None:
        return None
    attention = CpuAttention(lib)
    log.info("native decode attention: the %s path", attention.isa)
    return attention
