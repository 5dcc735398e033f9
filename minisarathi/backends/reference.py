"""The reference backend: every name of the Backend interface (backends/base.py), written the obvious way.

Every other backend (CpuOps, the fast CPU one; CudaOps on a GPU or the emulator) is tested against this
one, op by op and on whole models (tests/unit/test_reference_backend.py). So it is plain NumPy in float32,
with loops where a loop reads clearest, and it keeps nothing between calls: no caches, no native code, no
environment switches, no tuning. It is slow, and that is fine: it only has to be easy to believe.

The shapes and the rules (the batch contract, the KV cache layout) are in docs/architecture.md. Rows of `x`
are tokens; a KV cache is float32[num_blocks, Hk, block_size, D] per layer.
"""

from __future__ import annotations

import numpy as np

from minisarathi.backends.gemma_ops import GemmaNumpyOps
from minisarathi.batch import Batch
from minisarathi.sampler import Sampler


class ReferenceOps(GemmaNumpyOps):
    """The Backend interface on the host, in float32 NumPy, kept as simple as it can be."""

    device = "reference"
    activation_dtype = np.dtype(np.float32)  # of activations and the KV cache

    # ---- placement: every array is a float32 NumPy array in host memory ------------------------------------

    def weight(self, tensor) -> np.ndarray:
        # A loader CheckpointTensor widens itself to float32 in np.array (its __array__); a copy, C order.
        return np.array(tensor, dtype=np.float32)

    def linear_weight(self, placed: np.ndarray) -> np.ndarray:
        return placed  # linear reads HF's [out, in] layout as it is

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    def constant(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, dtype=np.float32)

    def upload_batch(self, batch: Batch, into: None = None) -> None:
        """Nothing to upload: the batch is already where this backend computes. Only overlap's decode tokens,
        sampled by the previous step, go into their rows of input_ids, as the interface asks."""
        if getattr(batch, "previous_ids", None) is not None:  # an OverlapBatch (engine/overlap.py)
            batch.input_ids[batch.previous_rows] = np.asarray(batch.previous_ids)[batch.previous_sources]
        return None

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    def free_memory_bytes(self) -> None:
        return None  # host memory: the engine uses its CPU default for the KV cache

    def new_sampler(self, vocab_size: int, seed: int = 0, eos_token_ids: tuple[int, ...] = ()) -> Sampler:
        return Sampler(vocab_size, seed, eos_token_ids)  # the one sampling rule, on host logits

    # ---- the ops of the forward pass -----------------------------------------------------------------------

    def embedding(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return table[ids]  # float32[T, H]: row ids[t] of table[V, H]

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        mean_square = np.mean(x * x, axis=-1, keepdims=True)  # float32[..., 1] from x[..., H]
        return x / np.sqrt(mean_square + np.float32(eps)) * w  # float32[..., H]

    def add_rms_norm(
        self, x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray]:
        residual += x  # in place: the interface hands the caller's residual back updated
        return self.rms_norm(residual, w, eps), residual

    def linear(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        out = x @ w.T  # float32[T, N] from x[T, K] and w[N, K]
        if bias is not None:
            out = out + bias
        return out

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
        """RoPE on q[T, Hq, D] in place; the rotated k[T, Hk, D] and v (k and v left as they are) written to
        the cache at slot_mapping[t] = block * block_size + offset. A negative slot is padding: not stored."""
        half = q.shape[2] // 2
        # float32[T, 1, D/2] each, the same for every head of a token: row p is [cos(p f) | sin(p f)]
        cos, sin = cos_sin[positions, None, :half], cos_sin[positions, None, half:]
        q[...] = rotate(q, cos, sin)
        k_rotated = rotate(k, cos, sin)  # float32[T, Hk, D]
        block_size = k_cache.shape[2]
        for t, slot in enumerate(slot_mapping):
            if slot < 0:
                continue
            block, offset = divmod(int(slot), block_size)
            k_cache[block, :, offset] = k_rotated[t]  # [Hk, D]
            v_cache[block, :, offset] = v[t]

    def paged_attention(
        self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, batch: Batch, scale: float, window=None
    ) -> np.ndarray:
        """float32[T, Hq, D]: query token t of sequence s, at position p, attends to the keys at positions
        0..p of s (causal; with a sliding window, p - window + 1..p), each read from the cache through s's
        block table. GQA: query head h reads KV head h // (Hq / Hk). Only those keys are read, so block-table
        entries outside them (past a context, or freed before a window) never matter."""
        T, Hq, D = q.shape
        Hk, block_size = k_cache.shape[1], k_cache.shape[2]
        group = Hq // Hk
        out = np.zeros((T, Hq, D), dtype=np.float32)
        for s in range(batch.num_seqs):
            table = batch.block_tables[s]
            for t in range(batch.query_start[s], batch.query_start[s + 1]):
                first = 0 if window is None else max(0, batch.positions[t] - window + 1)
                keys = np.arange(first, batch.positions[t] + 1)  # int[n]: positions first..p
                blocks, offsets = table[keys // block_size], keys % block_size
                # the KV heads repeated so that query head h lines up with KV head h // group
                K = np.repeat(k_cache[blocks, :, offsets], group, axis=1)  # float32[n, Hq, D]
                V = np.repeat(v_cache[blocks, :, offsets], group, axis=1)  # float32[n, Hq, D]
                scores = np.einsum("hd,khd->hk", q[t], K) * np.float32(scale)  # float32[Hq, n]
                weights = np.exp(scores - scores.max(axis=1, keepdims=True))  # softmax, shifted: no overflow
                weights /= weights.sum(axis=1, keepdims=True)
                out[t] = np.einsum("hk,khd->hd", weights, V)
        return out

    def silu_and_mul(self, x: np.ndarray) -> np.ndarray:
        """float32[T, I] = silu(gate) * up, for x = [gate | up] of float32[T, 2I]; silu(g) = g / (1 +
        e^-g)."""
        inter = x.shape[1] // 2
        gate, up = x[:, :inter], x[:, inter:]
        with np.errstate(over="ignore"):  # e^-g = inf for a very negative g: g / inf = -0, which is right
            return gate / (1 + np.exp(-gate)) * up

    def copy_blocks(
        self, kv_cache: list[tuple[np.ndarray, np.ndarray]], sources: list[int], destinations: list[int]
    ) -> None:
        """Block sources[i] onto block destinations[i] in every layer's k and v cache (copy-on-write)."""
        for k_cache, v_cache in kv_cache:
            # fancy indexing on the right is a copy: every source is read before any destination is written
            k_cache[destinations] = k_cache[sources]
            v_cache[destinations] = v_cache[sources]


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE in HF's half-split layout (rotate_half): the pair (x_i, x_{i + D/2}) turned by the angle p f_i.
    x: float32[T, H, D]; cos, sin: float32[T, 1, D/2]."""
    half = x.shape[2] // 2
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
