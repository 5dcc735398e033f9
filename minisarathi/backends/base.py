"""The one interface every backend implements: what the model and the engine may ask of it.

Three backends implement it: ReferenceOps (minisarathi/backends/reference.py, the plain float32 reference
the others are tested against), CpuOps (minisarathi/backends/cpu/ops.py, the fast CPU backend) and CudaOps
(minisarathi/backends/cuda_ops.py, the kernels of cuda/*.cu on a GPU or on the CPU emulator).
docs/architecture.md has the same list as a table with the shapes; tests/unit/test_backends.py checks that the
backends have every name listed here.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from minisarathi.batch import Batch

Array = Any  # a NumPy array on the CPU and the emulator, a CuPy array on a GPU


class Backend(Protocol):
    device: str  # "cpu", "reference", "cuda" or "cuda-emulated"
    activation_dtype: np.dtype  # of activations and the KV cache (uint16 holds bfloat16 bits)

    # placement
    def weight(self, tensor: Any) -> Array:
        """A loader CheckpointTensor (or a float32 array) placed on the device in the activation dtype."""

    def linear_weight(self, placed: Array) -> Any:
        """A weight that weight() placed, in the form linear reads fastest, for the weights linear reads
        (CpuOps: packed for its packed matmul kernel where that runs; CudaOps: the array itself)."""

    def zeros(self, shape: tuple[int, ...]) -> Array: ...
    def upload_batch(self, batch: Batch, into: Any = None) -> Any:
        """Puts a step's batch metadata on the device at once (one copy), before the forward's ops read it,
        and fills the rows of input_ids that take the previous step's sampled ids there (the previous_ids of
        an OverlapBatch, engine/overlap.py). Returns the device buffer it wrote (None where the arrays already
        are where the backend computes); into: such a buffer from an earlier batch of the same shapes, reused
        (a CUDA graph's static input)."""

    def constant(self, array: np.ndarray) -> Array:
        """A float32 table on the device, float32 whatever the activation dtype (config.rope_cos_sin())."""

    def to_numpy(self, x: Array) -> np.ndarray:
        """float32 NumPy copy (the logits' way back to the host)."""

    def free_memory_bytes(self) -> int | None:
        """Device memory free now, or None where the backend's arrays are host memory."""

    def new_sampler(self, vocab_size: int, seed: int = 0, eos_token_ids: tuple[int, ...] = ()) -> Any:
        """The sampler for this backend's logits (same rule on every backend; see minisarathi/sampler.py)."""

    # the ops of the forward pass (rows of x are tokens)
    def embedding(self, table: Array, ids: np.ndarray) -> Array: ...
    def rms_norm(self, x: Array, w: Array, eps: float) -> Array:
        """Over the last axis of x[T, H], or of a q/k view x[T, heads, D] (Qwen3's per-head norms)."""

    def add_rms_norm(self, x: Array, residual: Array, w: Array, eps: float) -> tuple[Array, Array]: ...
    def linear(self, x: Array, w: Array, bias: Array | None = None) -> Array:
        """x[T, K] @ w[N, K].T (+ bias[N]): [T, N]. CpuOps may hand on the transposed product's F-order
        view, so CpuOps' ops take any memory layout; CudaOps returns C order, which its kernels need."""

    def rope_store_kv(
        self,
        q: Array,
        k: Array,
        v: Array,
        k_cache: Array,
        v_cache: Array,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        cos_sin: Array,
    ) -> None:
        """RoPE on q in place; rotated k and v written into the cache (negative slot: not stored)."""

    def paged_attention(
        self, q: Array, k_cache: Array, v_cache: Array, batch: Batch, scale: float, window: int | None = None
    ) -> Array:
        """Query at position p sees its sequence's keys 0..p, or only p - window + 1..p (a sliding window)."""

    def silu_and_mul(self, x: Array) -> Array: ...
    def gelu_tanh_and_mul(self, x: Array) -> Array:
        """Gemma 3's GeGLU: gelu_tanh(x[:, :I]) * x[:, I:] (backends/gemma_ops.py)."""

    def softcap(self, x: Array, cap: float) -> Array:
        """tanh(x / cap) * cap (Gemma 3's logits; CudaOps in place)."""

    def copy_blocks(
        self, kv_cache: list[tuple[Array, Array]], sources: list[int], destinations: list[int]
    ) -> None:
        """KV block sources[i] copied onto block destinations[i] in every layer's k and v cache (n > 1:
        copy-on-write of a shared partial block)."""


def interface_names() -> list[str]:
    """Every attribute and method of Backend, for the tests that hold every backend to it."""
    methods = [name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")]
    return sorted([*Backend.__annotations__, *methods])
