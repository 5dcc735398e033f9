"""load_model: a checkpoint's model, of the family its architecture names: LlamaModel (model/llama.py: Llama,
Mistral, Qwen2, Qwen3) or a subclass beside it (model/gemma.py: Gemma 3)."""

from __future__ import annotations

from pathlib import Path

from minisarathi.backends.devices import make_backend
from minisarathi.config import ModelConfig
from minisarathi.model.gemma import Gemma3Model
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import load_weights

FAMILIES: dict[str, type[LlamaModel]] = {"Gemma3ForCausalLM": Gemma3Model}  # the rest: LlamaModel


def load_model(path: str | Path, device: str = "cpu", dtype: str = "auto") -> LlamaModel:
    """A Hugging Face folder's (or GGUF file's) model on the backend for `device` (backends/devices.py),
    computing in `dtype` ("auto": the checkpoint's on the CUDA backends)."""
    config = ModelConfig.from_pretrained(path)
    backend = make_backend(device, config.dtype if dtype == "auto" else dtype, explicit_dtype=dtype != "auto")
    return FAMILIES.get(config.architecture, LlamaModel)(config, load_weights(path, config), backend)
