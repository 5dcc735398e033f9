"""Configuration: ModelConfig is read from a Hugging Face config.json; EngineConfig holds the serving
knobs."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minisarathi.dtypes import DTYPES
from minisarathi.engine.speculative import SpeculativeConfig, speculative_config
from minisarathi.quant.gguf_file import config_dict, is_gguf
from minisarathi.quant.hf_quantized import read_scheme
from minisarathi.validation import check_float, check_int


def read_json_object(path: Path) -> dict:
    """A model folder's JSON file that must hold an object; ValueError naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return value


SCHEDULERS = ("sarathi", "vllm", "orca", "simple_chunking", "faster_transformer")
DEVICES = ("auto", "cpu", "cuda", "cuda-emulated", "reference")  # reference: backends/reference.py
ENGINE_DTYPES = ("auto", *DTYPES)


@dataclass
class EngineConfig:
    scheduler: str = "sarathi"
    chunk_size: int = 512  # per-iteration token budget of sarathi and simple_chunking; whole-prompt
    # policies use max(chunk_size, max_model_len)
    block_size: int = 16  # tokens per KV-cache block (the KV page); unrelated to chunk_size
    num_kv_blocks: int | None = None  # None: derived from kv_cache_bytes
    # Memory budget for the KV cache when num_kv_blocks is None. None: derived from the device (a share of
    # the GPU memory left free by the weights on the CUDA backend, 256 MiB on the CPU; docs/scheduling.md).
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = False
    device: str = "cpu"
    # Activation, weight and KV-cache dtype of the CUDA backends ("cuda", "cuda-emulated"): "auto" is the
    # checkpoint's, so an emulated run launches the kernels a GPU runs; "float32" emulates exactly against
    # the NumPy reference. On "cpu" the dtype of the linear weights and the embedding table ("auto": the
    # checkpoint's; bfloat16 or float16 keep them in 16 bits), activations and KV cache staying float32.
    # "reference" computes in float32 ("auto" or "float32" only).
    dtype: str = "auto"
    seed: int = 0  # seeds the sampler for requests without their own seed
    # sarathi only: size each step so that its predicted time stays within this TBT target (ms); chunk_size
    # stays the upper bound on its tokens (docs/scheduling.md, "SLO-driven budget")
    tbt_slo_ms: float | None = None
    # chunked policies: at most this many prompts mid-prefill at once, sharing the prefill budget evenly
    # (vLLM's max_num_partial_prefills); None: no limit
    max_partial_prefills: int | None = None
    long_prefill_threshold: int | None = None  # a prompt with more uncomputed tokens is "long"; None: 4% of
    # max_model_len (vLLM's long_prefill_token_threshold)
    max_long_partial_prefills: int | None = None  # at most this many of them long; None: 1 (vLLM's default)
    priority_aging_s: float = (
        10.0  # a request of priority p is ordered as if it arrived p x this many s later
    )
    # Megatron-style tensor parallelism over this many rank processes (minisarathi/parallel/; needs MPI:
    # pip install 'minisarathi[mpi]'); the ranks must answer each step within rank_timeout_s or are stopped
    tensor_parallel_size: int = 1
    rank_timeout_s: float = 120.0
    # BLAS threads of the process (the CPU backend's matmuls, the sampler). None: the CPUs other processes
    # leave idle at start-up, at least 1 (minisarathi/backends/cpu/process_setup.py).
    blas_threads: int | None = None
    # Overlap the host with the device (docs/performance.md, "Overlap"): each step is scheduled and its
    # forward issued before the host waits for the previous step's sampled ids. None: on for the CUDA backend
    # on a GPU, off elsewhere (the CPU backends and the emulator compute while issuing: nothing to overlap).
    overlap: bool | None = None
    # Decode-only steps padded to batch-size buckets and replayed as one CUDA graph per bucket, every bucket
    # captured at start-up (minisarathi/model/decode_graphs.py; a failed capture: logged, eager steps). None:
    # on for the CUDA backends ("cuda", "cuda-emulated"), off on "cpu"; True on "cpu" runs the padded buckets
    # without graphs (NumPy has none); False: every step eager. Tensor-parallel ranks run eagerly.
    cuda_graphs: bool | None = None
    # vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    # "prompt_lookup_min": m}; drafts verified within each step's budget (docs/scheduling.md, "Speculation")
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self):
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(ENGINE_DTYPES)}, got {self.dtype!r}")
        if self.overlap and self.tensor_parallel_size > 1:
            raise ValueError(
                "overlap needs tensor_parallel_size 1: the ranks take the input ids from the host"
            )
        fair = ("max_partial_prefills", "long_prefill_threshold", "max_long_partial_prefills")
        optional = (
            "num_kv_blocks",
            "kv_cache_bytes",
            "max_model_len",
            "blas_threads",
            *fair,
        )  # None: derived or off
        for name in ("chunk_size", "block_size", "max_num_seqs", *optional):
            if getattr(self, name) is not None or name not in optional:
                check_int(name, getattr(self, name), lo=1)
        check_int("seed", self.seed, lo=0)
        if self.cuda_graphs not in (None, True, False):
            raise ValueError(
                "cuda_graphs must be True, False or None (on for the CUDA backends), got "
                f"{self.cuda_graphs!r}"
            )
        check_int("tensor_parallel_size", self.tensor_parallel_size, lo=1)
        self.speculative_config = speculative_config(self.speculative_config)
        if self.speculative_config and self.overlap:
            raise ValueError("speculative_config needs overlap off: the drafts come from the host's tokens")
        for name in ("tbt_slo_ms", "priority_aging_s", "rank_timeout_s"):
            value = getattr(self, name)
            if value is not None and not check_float(name, value) > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.tbt_slo_ms is not None and self.scheduler != "sarathi":
            raise ValueError(f"tbt_slo_ms needs the sarathi scheduler, got scheduler {self.scheduler!r}")
        if self.max_partial_prefills is None:
            given = [name for name in fair[1:] if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{given[0]} needs max_partial_prefills")
        elif self.scheduler not in ("sarathi", "simple_chunking"):
            raise ValueError(
                f"max_partial_prefills needs a chunked scheduler (sarathi, simple_chunking), "
                f"got scheduler {self.scheduler!r}"
            )
        elif (self.max_long_partial_prefills or 1) > self.max_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_partial_prefills ({self.max_partial_prefills})"
            )


ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM",
)
GEMMA3_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
# transformers' Gemma3TextConfig defaults, for the fields a checkpoint's config may leave out (the
# multimodal ones' text_config often names only a few)
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "sliding_window": 4096,
}


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "linear", "llama3", "yarn" or "longrope" ("default" is stored as rope_scaling=None)
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and yarn
    beta_fast: float = 32.0  # yarn only: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0  # yarn only
    attention_factor: float = 1.0  # yarn and longrope: cos and sin are scaled by it (transformers' mscale)
    ext_factors: tuple[float, ...] = ()  # longrope: each frequency's divisor (long_factor or short_factor)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama and Qwen3 with attention_bias
    qk_norm: bool  # Qwen3: RMSNorm (weights [head_dim]) on each head of q and k before RoPE
    o_bias: bool  # Llama with attention_bias (Qwen2 has none on o_proj)
    dtype: str  # the checkpoint's dtype, one of DTYPES
    # Sliding-window attention: query position i sees keys j with i - sliding_window < j <= i, on the layers
    # where sliding_layers is True (None: every layer); None where every layer attends to all its keys.
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
    extra_layer_norms: tuple[str, ...] = ()  # per-layer RMSNorms besides Llama's two (Gemma 3's)
    # Gemma 3 (model/gemma.py): the attention scale's query_pre_attn_scalar**-0.5, the RoPE base of its
    # sliding layers (the global ones take rope_theta and rope_scaling), tanh soft-capping of the logits
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    final_logit_softcapping: float | None = None
    norms_include_one: bool = False  # Gemma 3 from GGUF: llama.cpp's converter stored 1 + w, not w
    multimodal: bool = False  # Gemma3ForConditionalGeneration: its text model's tensors are the model's
    rotary_dim: int | None = None  # Phi-3's partial_rotary_factor: RoPE turns each head's first dims only
    # BOS and EOS ids are the tokenizer's business: minisarathi.tokenizer.Tokenizer reads them.

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if is_gguf(path):
            return cls.from_dict(config_dict(path))
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"path {str(path)!r} has no config.json")
        try:
            return cls.from_dict(read_json_object(config_file))
        except ValueError as e:
            message = str(e)
            raise ValueError(
                message if message.startswith(str(config_file)) else f"{config_file}: {message}"
            ) from None
        except (
            TypeError,
            AttributeError,
        ):  # a field of the wrong JSON type deep in it (rope_scaling a list, ...)
            raise ValueError(
                f"{config_file}: a field has the wrong type for a Hugging Face config.json"
            ) from None

    @classmethod
    def from_dict(cls, config: dict) -> ModelConfig:
        """Reads a Hugging Face config.json dict."""
        architectures = config.get("architectures") or []
        if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
            raise ValueError(
                f"architectures must be one of {', '.join(ARCHITECTURES)}, got {architectures!r}"
            )
        arch = architectures[0]
        if config.get("quantization_config") is not None:
            read_scheme(config["quantization_config"])  # refused here, before any tensor is read
        if config.get("mlp_bias", False):
            raise ValueError(f"mlp_bias must be false, got {config['mlp_bias']!r}")
        if arch == "Gemma3ForCausalLM":
            return cls._from_gemma3(config)
        if arch == "Gemma3ForConditionalGeneration":
            return cls._from_gemma3_multimodal(config)
        if arch == "Phi3ForCausalLM":
            config = _phi3_legacy_rope(config)
            return _from_phi3(cls.from_dict({**config, "architectures": ["LlamaForCausalLM"]}), config)
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {config['hidden_act']!r}")
        max_positions = _positive_int(config, "max_position_embeddings")
        window = _sliding_window(arch, config, max_positions)

        hidden = _positive_int(config, "hidden_size")
        heads = _positive_int(config, "num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
            raise ValueError(
                f"num_key_value_heads must divide num_attention_heads ({heads}), got {kv_heads!r}"
            )
        head_dim = config.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be a positive even integer, got {head_dim!r}")
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        rope_theta, rope_scaling = _read_rope(config)
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=_positive_int(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(config, "intermediate_size"),
            num_hidden_layers=_positive_int(config, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            dtype=dtype,
            sliding_window=window,
        )

    @classmethod
    def _from_gemma3_multimodal(cls, config: dict) -> ModelConfig:
        """Gemma3ForConditionalGeneration's language model: its text_config, the dtype given beside it."""
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("a Gemma3ForConditionalGeneration config must have a text_config object")
        dtype = config.get("dtype") or config.get("torch_dtype")
        text = {"dtype": dtype, **text, "architectures": ["Gemma3ForCausalLM"]}
        return dataclasses.replace(cls._from_gemma3(text), multimodal=True)

    @classmethod
    def _from_gemma3(cls, config: dict) -> ModelConfig:
        """Gemma 3 text: GeGLU (tanh GELU), (1 + w) norms, q/k norms, interleaved sliding and global layers
        (layer_types, or every sliding_window_pattern-th global), each kind with its own RoPE, tied
        embeddings by default."""
        config = {**GEMMA3_TEXT_DEFAULTS, **config}
        activation = config.get("hidden_activation", config.get("hidden_act", "gelu_pytorch_tanh"))
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation must be 'gelu_pytorch_tanh', got {activation!r}")
        if config.get("attn_logit_softcapping") is not None:  # transformers' Gemma3Attention never applies it
            raise ValueError(f"attn_logit_softcapping must be null, got {config['attn_logit_softcapping']!r}")
        if config.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention must be false (a causal language model)")
        layers = _positive_int(config, "num_hidden_layers")
        pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
        types = config.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ]
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(
                f"layer_types must name sliding_attention or full_attention for each of the {layers} layers"
            )
        params = config.get("rope_parameters")
        if params is not None and "full_attention" in params:  # transformers 5: one set per layer type
            local = params.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"the sliding layers' rope_type must be default, got {local['rope_type']!r}")
            config = {**config, "rope_parameters": params["full_attention"]}
            local_theta = local.get("rope_theta", 10000.0)
        else:
            local_theta = config.get("rope_local_base_freq", 10000.0)
        softcap = config.get("final_logit_softcapping")
        llama = {
            **config,
            "architectures": ["LlamaForCausalLM"],
            "hidden_act": "silu",  # checked above; the Llama reading checks the rest
            "sliding_window": None,
            "tie_word_embeddings": config.get("tie_word_embeddings", True),
        }
        return dataclasses.replace(
            cls.from_dict(llama),
            architecture="Gemma3ForCausalLM",
            qk_norm=True,
            sliding_window=check_int("sliding_window", config.get("sliding_window"), lo=1),
            sliding_layers=tuple(t == "sliding_attention" for t in types),
            extra_layer_norms=GEMMA3_NORMS,
            query_pre_attn_scalar=check_float(
                "query_pre_attn_scalar", config.get("query_pre_attn_scalar", 256)
            ),
            local_rope_theta=check_float("rope_local_base_freq", local_theta),
            final_logit_softcapping=None
            if softcap is None
            else check_float("final_logit_softcapping", softcap),
            norms_include_one=config.get("norms_include_one", False) is True,
        )

    def local_rope_cos_sin(self) -> np.ndarray:
        """Gemma 3's sliding layers' table: default RoPE over local_rope_theta (rope_cos_sin's layout)."""
        return dataclasses.replace(self, rope_theta=self.local_rope_theta, rope_scaling=None).rope_cos_sin()

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention), as paged_attention takes it."""
        sliding = self.sliding_layers or (True,) * self.num_hidden_layers
        return [self.sliding_window if s else None for s in sliding]

    @property
    def kv_window(self) -> int | None:
        """The window of every layer, where all of them slide: the KV blocks before it can be freed."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    def rope_cos_sin(self) -> np.ndarray:
        """float32[max_position_embeddings, head_dim]: row p is [cos(p * inv_freq) | sin(p * inv_freq)], the
        angles taken in float64 so that far positions stay exact to float32 (a float32 product p * inv_freq
        is off by up to 0.004 rad at p = 100k). Built once per model; the rope_store_kv op reads it by
        position."""
        table = rope_cos_sin_table(self.rope_inv_freq(), self.max_position_embeddings)
        if self.rope_scaling is None:
            return table
        # the attention factor scales the turned dims only: partial rotary's passed ones stay cos 1, sin 0
        turned = np.tile(np.arange(self.head_dim // 2) < (self.rotary_dim or self.head_dim) // 2, 2)  # [D]
        return table * np.where(turned, np.float32(self.rope_scaling.attention_factor), np.float32(1))

    def rope_inv_freq(self) -> np.ndarray:
        """float32[head_dim/2]: RoPE frequencies with the scaling folded in, computed in float64; zeros
        (cos 1, sin 0) past rotary_dim/2, the dims partial rotary passes through (model/phi3.py's order)."""
        dim = self.rotary_dim or self.head_dim
        rotary = self._scaled_inv_freq(
            1.0 / self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        )
        return np.concatenate([rotary, np.zeros((self.head_dim - dim) // 2, np.float32)])

    def _scaled_inv_freq(self, inv_freq: np.ndarray) -> np.ndarray:
        scaling, dim = self.rope_scaling, self.rotary_dim or self.head_dim
        if scaling is None:
            return inv_freq.astype(np.float32)
        if scaling.rope_type == "linear":  # positions / factor == frequencies / factor
            return (inv_freq / scaling.factor).astype(np.float32)
        if scaling.rope_type == "yarn":
            return _yarn_inv_freq(inv_freq, dim, self.rope_theta, scaling)
        if scaling.rope_type == "longrope":  # as transformers' _compute_longrope_parameters, in float64
            return (inv_freq / np.asarray(scaling.ext_factors, dtype=np.float64)).astype(np.float32)
        # llama3, as transformers' _compute_llama3_parameters: long wavelengths are slowed down by
        # `factor`, short ones kept, and the band between them interpolated smoothly.
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin_table(inv_freq: np.ndarray, num_positions: int) -> np.ndarray:
    """float32[num_positions, 2 * len(inv_freq)]: [cos | sin] of position * inv_freq, angles in float64."""
    angles = np.arange(num_positions, dtype=np.float64)[:, None] * inv_freq.astype(np.float64)
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def _yarn_inv_freq(inv_freq: np.ndarray, dim: int, base: float, scaling: RopeScaling) -> np.ndarray:
    """float32[dim/2]: YaRN as transformers' _compute_yarn_parameters: frequencies that turn fewer than
    beta_slow times over the original context are interpolated (/ factor), those turning more than beta_fast
    times kept, with a linear ramp over the dimensions between."""

    def correction_dim(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return (
            dim
            * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low or 0.001), 0, 1)
    return (inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)).astype(np.float32)


def _positive_int(config: dict, name: str) -> int:
    return check_int(name, config.get(name), lo=1)


def _sliding_window(arch: str, config: dict, max_positions: int) -> int | None:
    """Mistral's window over every layer (Qwen2/Qwen3's use_sliding_window is refused); None where it covers
    every position, which is full attention."""
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if config.get("use_sliding_window", False):
            raise ValueError(f"use_sliding_window must be false, got {config['use_sliding_window']!r}")
        return None
    window = config.get("sliding_window")
    if window is None:
        return None
    check_int("sliding_window", window, lo=1)
    return window if window < max_positions else None


# Gemma3ForConditionalGeneration's language-model prefixes: transformers >= 4.52's, then the older one
LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model."}
LANGUAGE_MODEL_PREFIXES["language_model.lm_head."] = "lm_head."


def language_model(tensors: dict) -> dict:
    """A multimodal checkpoint's text-model tensors under a causal LM's names; the rest (vision tower,
    projector) are left out, and how many is logged."""
    text = {}
    for name, tensor in tensors.items():
        prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            text[LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix) :]] = tensor
        elif name == "lm_head.weight":
            text[name] = tensor
    logging.getLogger("minisarathi.loader").info(
        "multimodal checkpoint: %d text-model tensors read, %d others (vision) ignored",
        len(text),
        len(tensors) - len(text),
    )
    return text


def _read_rope(config: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from transformers 5's rope_parameters or 4's rope_theta/rope_scaling."""
    params = config.get("rope_parameters")
    if params is not None:
        scaling = params
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    else:
        scaling = config.get("rope_scaling") or {}
        theta = config.get("rope_theta", 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ("dynamic", "linear", "llama3", "yarn", "longrope"):
        raise ValueError(
            f"rope_type must be one of default, dynamic, linear, llama3, yarn, longrope, got {rope_type!r}"
        )
    if rope_type == "dynamic":
        # transformers' dynamic NTK rescales only past max_position_embeddings, which max_model_len never
        # passes: within it the frequencies are the default ones
        _check_positive(scaling, ("factor",))
        return float(theta), None
    if rope_type == "yarn":
        return float(theta), _read_yarn(config, scaling)
    if rope_type == "longrope":
        return float(theta), _read_longrope(config, scaling)
    keys = (
        ("factor",)
        if rope_type == "linear"
        else ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    _check_positive(scaling, keys)
    return float(theta), RopeScaling(rope_type, **{k: scaling[k] for k in keys})


def _check_positive(scaling: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if not isinstance(scaling.get(key), (int, float)) or scaling[key] <= 0:
            raise ValueError(f"rope scaling {key} must be a positive number, got {scaling.get(key)!r}")


def _read_yarn(config: dict, scaling: dict) -> RopeScaling:
    """YaRN's parameters with transformers' defaults (beta_fast 32, beta_slow 1, the original context
    max_position_embeddings) and its attention factor: 0.1 ln(factor) + 1, or the mscale ratio."""
    if scaling.get("truncate", True) is not True:
        raise ValueError(f"rope scaling truncate must be true, got {scaling['truncate']!r}")
    given = {
        k: scaling[k]
        for k in (
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
        )
        if scaling.get(k) is not None
    }
    values = {"original_max_position_embeddings": config["max_position_embeddings"], **given}
    _check_positive({"factor": scaling.get("factor"), **values}, ("factor", *values))
    factor = scaling["factor"]

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if "attention_factor" not in values:
        both = "mscale" in values and "mscale_all_dim" in values
        values["attention_factor"] = (
            mscale(values["mscale"]) / mscale(values["mscale_all_dim"]) if both else mscale()
        )
    values.pop("mscale", None), values.pop("mscale_all_dim", None)
    return RopeScaling("yarn", factor, **values)


def _partial_rotary_dim(config: dict) -> int:
    """The head dims RoPE turns: int(head_dim * partial_rotary_factor), as transformers' Phi3 takes it."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    factor = config.get("partial_rotary_factor", 1.0) if factor is None else factor
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2 or (head_dim - dim) % 2:
        raise ValueError(
            f"partial_rotary_factor {factor} gives {dim} of head_dim {head_dim}: both must be even"
        )
    return dim


def _phi3_legacy_rope(config: dict) -> dict:
    """config with rope type "su" or "yarn" named longrope, as transformers' Phi3Config reads them."""
    key = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    scaling = config.get(key)
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in ("su", "yarn"):
        return {**config, key: {**scaling, "rope_type": "longrope"}}
    return config


def _from_phi3(llama: ModelConfig, config: dict) -> ModelConfig:
    """Phi3ForCausalLM: Llama's layers (the loader splits the fused qkv_proj and gate_up_proj), partial
    rotary where partial_rotary_factor < 1."""
    dim = _partial_rotary_dim(config)
    return dataclasses.replace(
        llama, architecture="Phi3ForCausalLM", rotary_dim=None if dim == llama.head_dim else dim
    )


def _read_longrope(config: dict, scaling: dict) -> RopeScaling:
    """LongRoPE as transformers' _compute_longrope_parameters: each frequency divided by its factor, the
    long_factor list where max_position_embeddings passes original_max_position_embeddings (the engine
    turns every position with one table: see README, Supported checkpoints), short_factor otherwise; cos and
    sin scaled by sqrt(1 + ln(factor) / ln(original)), factor max_position_embeddings / original if not
    given."""
    original = scaling.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    check_int("original_max_position_embeddings", original, lo=1)
    factor = scaling.get("factor") or config["max_position_embeddings"] / original
    _check_positive({"factor": factor}, ("factor",))
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    _check_positive({"attention_factor": attention_factor}, ("attention_factor",))
    length = _partial_rotary_dim(config) // 2
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not (
            isinstance(values, list)
            and len(values) == length
            and all(isinstance(v, (int, float)) and v > 0 for v in values)
        ):
            raise ValueError(f"rope scaling {key} must be a list of {length} positive numbers")
    key = "long_factor" if config["max_position_embeddings"] > original else "short_factor"
    return RopeScaling(
        "longrope",
        factor,
        original_max_position_embeddings=original,
        attention_factor=attention_factor,
        ext_factors=tuple(float(v) for v in scaling[key]),
    )
