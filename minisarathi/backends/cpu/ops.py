"""The fast CPU backend: the ops of docs/architecture.md in float32 NumPy, with native kernels where they run.

It is held to the plain reference (minisarathi/backends/reference.py) op by op and on whole models. Rows of
`x` are tokens. A linear layer's weight is packed at load for the packed matmul kernel where it runs
(AVX-512 and a C++ compiler: minisarathi/backends/cpu/packed_gemm.py); elsewhere weights keep HF's [out, in]
layout, and a linear layer is `x @ w.T`, which BLAS reads as a transposed operand without a copy, or the
transposed product `w @ x.T` (transposed_linear). A quantized matrix (GGUF, AWQ, GPTQ) stays in its compact
form (quant_linear.QuantWeight) and runs through the quantized kernel (minisarathi/backends/cpu/
quant_linear.py); an embedding table kept so dequantizes only the rows looked up. With a 16-bit weight dtype
the matrices stay bf16 or fp16 (minisarathi/backends/cpu/half_linear.py).
"""

from __future__ import annotations

import weakref

import numpy as np

from minisarathi.backends.cpu import attention, half_linear, native_attention, packed_gemm, quant_linear
from minisarathi.backends.cpu.attention import AttentionPlan, DecodeKV, GatherBuffers
from minisarathi.backends.cpu.half_linear import HalfWeight
from minisarathi.backends.cpu.packed_gemm import PackedWeight
from minisarathi.backends.cpu.process_setup import AVX512_CORES, openblas_core, yield_blas_to_kernels
from minisarathi.backends.cpu.quant_linear import QuantWeight
from minisarathi.backends.gemma_ops import GemmaNumpyOps
from minisarathi.batch import Batch
from minisarathi.model.loader import CheckpointTensor
from minisarathi.sampler import Sampler

# Where CpuOps.linear computes the transposed product w @ x.T ([N, M], handed on as its [M, N] view, no copy;
# the MLP then runs feature-major without a copy) instead of x @ w.T: OpenBLAS's AVX-512 kernels do that
# product faster at these row counts (docs/cpu_performance.md, "Weight matmuls"); other kernels and other
# BLAS keep x @ w.T.
TRANSPOSED_ROWS = range(2, 129)


def transposed_linear(rows: int, blas_core: str | None) -> bool:
    """Whether CpuOps.linear computes x[rows, K] @ w.T as (w @ x.T).T, for OpenBLAS kernels `blas_core`."""
    return blas_core in AVX512_CORES and rows in TRANSPOSED_ROWS


class CpuOps(GemmaNumpyOps):
    """The Backend interface (minisarathi/backends/base.py) on the CPU.

    Every layer of a forward pass sees the same batch, so what the ops derive from the batch alone (RoPE's
    cos/sin, the cache slots, attention's tile indices and padding mask) is computed by the first layer and
    kept until the batch changes: at small models each NumPy call costs as much as the arithmetic. An
    instance serves one forward at a time.
    """

    device = "cpu"
    activation_dtype = np.dtype(np.float32)  # of activations and the KV cache

    def __init__(self, weight_dtype: str = "float32"):
        self.weight_dtype = half_linear.check_dtype(weight_dtype)  # of the matrices (half_linear.keeps)
        self.blas_core = openblas_core()  # the OpenBLAS kernels in force, which choose linear's product
        self._rope_tables = (None, None, {})  # (positions, cos_sin, column tables by head count), last call
        self._rope_partners: dict[tuple[int, int], np.ndarray] = {}  # rotate_half's columns, by (heads, D)
        self._slots = (None,) * 5  # (slot_mapping, block_size, stored, blocks, offsets), last store
        self._attention_plan: AttentionPlan | None = None
        self._gather_buffers = GatherBuffers()
        self._decode_kv: dict[int, tuple[weakref.ref, DecodeKV]] = {}  # by id(k_cache), one per layer
        self._kept_memory: dict[int, np.ndarray] = {}  # by id(cache): its DecodeKV memory, made with it
        # by id(k_cache): the layer's caches and their data addresses, for the native decode attention
        self._cache_addresses: dict[int, tuple[weakref.ref, weakref.ref, tuple[int, int]]] = {}

    def free_memory_bytes(self) -> None:
        return None  # host memory: the engine uses its CPU default for the KV cache

    def new_sampler(self, vocab_size: int, seed: int = 0, eos_token_ids: tuple[int, ...] = ()) -> Sampler:
        return Sampler(vocab_size, seed, eos_token_ids)

    def weight(self, array: np.ndarray | CheckpointTensor) -> np.ndarray | QuantWeight | HalfWeight:
        """float32; a QuantWeight for a quantized matrix (quant_linear.runs; other quantized layouts, FP8,
        are dequantized); a HalfWeight for a 16-bit dtype's matrices."""
        if isinstance(array, CheckpointTensor) and quant_linear.runs(array.data):
            yield_blas_to_kernels()
            return quant_linear.quant_weight(array.data)
        if half_linear.keeps(array, self.weight_dtype):
            yield_blas_to_kernels()
            return half_linear.half_weight(array, self.weight_dtype)
        return np.ascontiguousarray(array, dtype=np.float32)

    def linear_weight(
        self, placed: np.ndarray | QuantWeight | HalfWeight
    ) -> PackedWeight | QuantWeight | HalfWeight | np.ndarray:
        """A QuantWeight or HalfWeight as it is; else packed once for the packed matmul kernel where
        packed_gemm.packs says so (the kernel runs here, the weight is deep enough to gain, BLAS runs one
        thread); else `placed` itself. A weight's form is fixed at load: linear uses the same kernel at every
        row count, so a row's result is bit-identical whatever batch it is in."""
        if isinstance(placed, (QuantWeight, HalfWeight)) or not packed_gemm.packs(placed.shape[1]):
            return placed
        return packed_gemm.kernel().pack(placed)

    def upload_batch(self, batch: Batch, into: None = None) -> None:
        """The batch's arrays are already where this backend computes: only the tokens the previous step
        sampled (batch.previous_ids) go into their rows of input_ids."""
        if getattr(batch, "previous_ids", None) is not None:  # an OverlapBatch (engine/overlap.py)
            batch.input_ids[batch.previous_rows] = batch.previous_ids[batch.previous_sources]

    def constant(self, array: np.ndarray) -> np.ndarray:
        return np.asarray(array, dtype=np.float32)

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        # Written now: np.zeros' pages are mapped on first write, so a KV cache's blocks would page-fault (and
        # be zeroed by the kernel) inside the steps that first use them.
        out = np.empty(shape, dtype=np.float32)
        out.fill(0)
        # and, for the same reason, the memory a layer's decode K/V is kept in (attention.kept_memory),
        # where the cache is large enough for its decode K/V ever to be kept (AttentionPlan.keeps_decode_kv)
        # and decodes run on NumPy (the native kernel reads the cache in place: native_attention.runs)
        if 2 * out.nbytes > attention.DECODE_GROUP_BYTES and not native_attention.runs():
            self._kept_memory[id(out)] = attention.kept_memory(out.size)
            weakref.finalize(out, self._kept_memory.pop, id(out), None)
        return out

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    def embedding(self, table: np.ndarray | QuantWeight | HalfWeight, ids: np.ndarray) -> np.ndarray:
        if isinstance(table, QuantWeight):  # only the rows asked for are dequantized
            return table.rows(ids)  # float32[T, H]
        return np.take(table, ids, axis=0)  # float32[T, H]

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        # x[..., H] (a q/k view [T, heads, D] included): float32[...], no x*x temporary
        mean_square = np.einsum("...h,...h->...", x, x) / x.shape[-1]
        scale = 1.0 / np.sqrt(mean_square + np.float32(eps))
        out = x * scale[..., None]
        out *= w
        return out

    def add_rms_norm(
        self, x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray]:
        residual += x
        return self.rms_norm(residual, w, eps), residual

    def linear(
        self,
        x: np.ndarray,
        w: PackedWeight | QuantWeight | HalfWeight | np.ndarray,
        bias: np.ndarray | None = None,
    ) -> np.ndarray:
        """float32[T, N] = x[T, K] @ w[N, K].T (+ bias); in F order (a view of the [N, T] product) where
        transposed_linear chooses the transposed product of an unpacked weight."""
        if isinstance(w, PackedWeight):
            out = packed_gemm.kernel().matmul(x, w)
        elif isinstance(w, QuantWeight):
            out = quant_linear.matmul(x, w)
        elif isinstance(w, HalfWeight):
            out = half_linear.matmul(x, w)
        elif transposed_linear(x.shape[0], self.blas_core):
            out = (w @ x.T).T
        else:
            out = x @ w.T  # float32[T, N]
        if bias is not None:
            out += bias
        return out

    def store_kv(
        self, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray
    ) -> None:
        """Scatters token t's k[t], v[t] into slot slot_mapping[t]; a negative slot is padding, not stored."""
        block_size = k_cache.shape[2]
        last_slot_mapping, last_block_size, stored, blocks, offsets = self._slots
        if slot_mapping is not last_slot_mapping or block_size != last_block_size:
            stored = slot_mapping >= 0
            stored = None if stored.all() else stored  # None: every token is stored
            blocks, offsets = np.divmod(slot_mapping if stored is None else slot_mapping[stored], block_size)
            self._slots = slot_mapping, block_size, stored, blocks, offsets
        if stored is not None:
            k, v = k[stored], v[stored]
        self._report_written(k_cache, blocks)
        # Caches are [num_blocks, Hk, block_size, D]; indexing axes 0 and 2 selects [T, Hk, D].
        k_cache[blocks, :, offsets] = k
        v_cache[blocks, :, offsets] = v

    def paged_attention(
        self,
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        batch: Batch,
        scale: float,
        window: int | None = None,
    ) -> np.ndarray:
        """float32[T, Hq, D]: each query attends causally to its own sequence's keys in the paged cache (with
        a sliding window, to the last `window` of them up to its own).

        Single-token runs (decodes) are done together: by the native kernel, which reads the cache in place,
        where it runs here (native_attention.runs: fixed per machine, so a row's result never depends on its
        batch); else on NumPy, padded to the longest context (the padding reads block-table
        entries past a context and masks them out, so the cache must hold finite numbers, as zeros() and a
        finite model keep it). Longer runs (prefill chunks) one sequence at a time, on NumPy. How: see
        minisarathi/backends/cpu/attention.py and native_attention.py.
        """
        plan = self._attention_plan
        if plan is None or not plan.describes(batch, k_cache):
            native_query_heads = q.shape[1] if native_attention.runs() else None
            plan = self._attention_plan = AttentionPlan(
                batch, *k_cache.shape, native_query_heads=native_query_heads
            )
        if plan.native_decodes is not None:
            native = native_attention.kernel(), self._addresses(k_cache, v_cache)
            return attention.paged_attention(
                q, k_cache, v_cache, plan, self._gather_buffers, scale, window, native=native
            )
        decode_kv = self._layer_decode_kv(k_cache, v_cache) if plan.keeps_decode_kv else None
        return attention.paged_attention(
            q, k_cache, v_cache, plan, self._gather_buffers, scale, window, decode_kv
        )

    def _addresses(self, k_cache: np.ndarray, v_cache: np.ndarray) -> tuple[int, int]:
        """k_cache's and v_cache's data addresses, read once per layer's caches (.ctypes.data is slow)."""
        known = self._cache_addresses.get(id(k_cache))
        if known is None or known[0]() is not k_cache or known[1]() is not v_cache:
            if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
                raise ValueError("paged_attention: the KV caches must be C-contiguous")
            if not k_cache.dtype == v_cache.dtype == np.float32:
                raise TypeError(f"paged_attention: the KV caches must be float32, got {k_cache.dtype}")
            known = weakref.ref(k_cache), weakref.ref(v_cache), (k_cache.ctypes.data, v_cache.ctypes.data)
            self._cache_addresses[id(k_cache)] = known
            weakref.finalize(k_cache, self._cache_addresses.pop, id(k_cache), None)
        return known[2]

    def _report_written(self, k_cache: np.ndarray, blocks: np.ndarray) -> None:
        """Every write into a cache goes through here, so that a layer's kept decode K/V knows what
        changed."""
        kept = self._decode_kv.get(id(k_cache))
        if kept is not None and kept[0]() is k_cache:
            kept[1].written(blocks)

    def _layer_decode_kv(self, k_cache: np.ndarray, v_cache: np.ndarray) -> DecodeKV:
        kept = self._decode_kv.get(id(k_cache))
        if kept is None or kept[0]() is not k_cache:
            # caches made elsewhere than zeros() (tests) get their memory now
            memory = tuple(self._kept_memory.pop(id(cache), None) for cache in (k_cache, v_cache))
            memory = tuple(attention.kept_memory(k_cache.size) if m is None else m for m in memory)
            kept = self._decode_kv[id(k_cache)] = weakref.ref(k_cache), DecodeKV(k_cache, memory)
            weakref.finalize(k_cache, self._decode_kv.pop, id(k_cache), None)  # a dead cache's copy goes too
        return kept[1]

    def rope_store_kv(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        cos_sin: np.ndarray,
    ) -> None:
        """Rotates q[T, Hq, D] in place and writes the rotated k[T, Hk, D] and v into the cache at
        slot_mapping (negative slot: not stored); k and v are left as they are. cos_sin: config.rope_cos_sin()
        (float32[P, D]); pairs are (i, i + D/2) as in HF's rotate_half.

        Whole rows at a time: x * cos + rotate_half(x) * sin over [T, H * D], with cos and (-sin | sin) laid
        out per column once per batch, instead of the pairwise formula on [T, H, D/2] views: a few calls with
        long inner loops rather than many with loops of D/2 numbers, bit for bit the same results. The column
        tables are contiguous for each head count (q's and k's): a product with a strided slice of a wider
        table takes NumPy's slower general loop."""
        last_positions, last_cos_sin, tables = self._rope_tables
        if positions is not last_positions or cos_sin is not last_cos_sin:
            tables = {}
            self._rope_tables = positions, cos_sin, tables
        q[...] = self._rotated(q, self._rope_columns(tables, q.shape[1], positions, cos_sin))
        k_rotated = self._rotated(k, self._rope_columns(tables, k.shape[1], positions, cos_sin))
        self.store_kv(k_rotated, v, k_cache, v_cache, slot_mapping)

    def _rope_columns(self, tables: dict, heads: int, positions: np.ndarray, cos_sin: np.ndarray):
        """(cos, -sin | sin) per column (float32[T, heads * D] each) and rotate_half's source column of each
        column, made at the batch's first layer: broadcast into place (fewer calls than np.tile)."""
        columns = tables.get(heads)
        if columns is None:
            table = cos_sin.take(positions, axis=0)  # float32[T, D]: cos | sin
            T, D = table.shape
            half = D // 2
            cos = np.empty((T, heads, 2, half), np.float32)
            cos[...] = table[:, None, None, :half]
            sin = np.empty((T, heads, 2, half), np.float32)
            np.negative(table[:, None, half:], out=sin[:, :, 0])
            sin[:, :, 1] = table[:, None, half:]
            partner = self._rope_partners.get((heads, D))
            if partner is None:  # the other half of the same head
                partner = np.arange(heads * D).reshape(heads, 2, half)[:, ::-1].ravel()  # int[heads * D]
                self._rope_partners[heads, D] = partner
            columns = tables[heads] = cos.reshape(T, heads * D), sin.reshape(T, heads * D), partner
        return columns

    @staticmethod
    def _rotated(x: np.ndarray, columns) -> np.ndarray:
        """float32[T, H, D]: x[T, H, D] rotated with rope_store_kv's column tables for H heads."""
        cos_rows, sin_rows, partner = columns
        T, H, D = x.shape
        rows = x.reshape(T, H * D)
        rotated = rows.take(partner, axis=1)  # rotate_half(x)
        rotated *= sin_rows
        rotated += rows * cos_rows
        return rotated.reshape(T, H, D)

    def copy_blocks(
        self, kv_cache: list[tuple[np.ndarray, np.ndarray]], sources: list[int], destinations: list[int]
    ) -> None:
        for k_cache, v_cache in kv_cache:
            k_cache[destinations] = k_cache[sources]
            v_cache[destinations] = v_cache[sources]
            self._report_written(k_cache, np.asarray(destinations))

    def silu_and_mul(self, x: np.ndarray) -> np.ndarray:
        """float32[T, I] = silu(gate) * up for x = [gate | up] of float32[T, 2I]."""
        inter = x.shape[1] // 2
        gate, up = x[:, :inter], x[:, inter:]
        out = np.negative(gate)
        with np.errstate(over="ignore"):  # exp(-gate) = inf for a very negative gate: silu = -0, correctly
            np.exp(out, out=out)
        out += 1
        np.divide(gate, out, out=out)
        out *= up
        return out
