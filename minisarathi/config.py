"""Configuration: ModelConfig is read from a Hugging Face config.json; EngineConfig holds the serving knobs."""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULERS = ("sarathi", "vllm", "orca", "simple_chunking", "faster_transformer")
DEVICES = ("auto", "cpu", "cuda", "cuda-emulated")


@dataclass
class EngineConfig:
    scheduler: str = "sarathi"
    chunk_size: int = 512            # Sarathi's per-iteration token budget (all policies' token limit)
    block_size: int = 16             # tokens per KV-cache block (the KV page); unrelated to chunk_size
    num_kv_blocks: int | None = None # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 256 << 20  # memory budget for the KV cache when num_kv_blocks is None
    max_num_seqs: int = 128
    max_model_len: int | None = None # None: the model's max_position_embeddings
    enable_prefix_caching: bool = False
    device: str = "cpu"
    seed: int = 0                    # seeds the sampler for requests without their own seed

    def __post_init__(self):
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        for name in ("chunk_size", "block_size", "max_num_seqs", "kv_cache_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
