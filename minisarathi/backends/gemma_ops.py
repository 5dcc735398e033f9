"""The two ops Gemma 3 adds to the backend interface, in float32 NumPy for the reference and CPU backends
(CudaOps runs cuda/gemma.cu): GeGLU with tanh GELU, and tanh soft-capping of the logits. Both as
transformers' Gemma3 computes them (gelu_pytorch_tanh; logits / cap -> tanh -> * cap)."""

from __future__ import annotations

import math

import numpy as np

SQRT_2_OVER_PI = np.float32(math.sqrt(2 / math.pi))


class GemmaNumpyOps:
    """gelu_tanh_and_mul and softcap for a backend whose arrays are float32 NumPy (any memory layout)."""

    def gelu_tanh_and_mul(self, x: np.ndarray) -> np.ndarray:
        """float32[T, I] = gelu_tanh(gate) * up for x = [gate | up] of float32[T, 2I]:
        gelu_tanh(g) = g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))."""
        inter = x.shape[1] // 2
        gate, up = x[:, :inter], x[:, inter:]
        inner = SQRT_2_OVER_PI * (gate + np.float32(0.044715) * gate * gate * gate)
        return np.float32(0.5) * gate * (1 + np.tanh(inner)) * up

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        """tanh(x / cap) * cap: logits squashed into (-cap, cap)."""
        return np.tanh(x / np.float32(cap)) * np.float32(cap)
