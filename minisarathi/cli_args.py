"""The command-line flags that several commands share (engine options, sampling, the API key), built from the
dataclasses they fill so a field's flag, default and meaning are written once. Imports none of the commands."""
from __future__ import annotations

import argparse
import os
from dataclasses import fields
from pathlib import Path

from minisarathi.config import DEVICES, ENGINE_DTYPES, SCHEDULERS, EngineConfig

API_KEY_ENV = "MINISARATHI_API_KEY"


def add_engine_arguments(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """The engine options, named as EngineConfig's fields (chunk_size -> --chunk-size)."""
    model_help = "Hugging Face model folder (default: the bundled stories260K)"
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, help=model_help)
    else:
        parser.add_argument("--model", default=None, help=model_help)
    parser.set_defaults(model_arg="model" if positional_model else "--model")   # its name in errors
    d = EngineConfig()   # the defaults live in one place
    g = parser.add_argument_group("engine")
    g.add_argument("--device", choices=DEVICES, default=d.device)
    g.add_argument("--dtype", choices=ENGINE_DTYPES, default=d.dtype,
                   help="CUDA backends' compute dtype (default auto: the checkpoint's; float32 for an exact "
                        "emulation against the CPU)")
    g.add_argument("--scheduler", choices=SCHEDULERS, default=d.scheduler)
    g.add_argument("--chunk-size", type=int, default=d.chunk_size,
                   help=f"per-iteration token budget (default {d.chunk_size})")
    g.add_argument("--block-size", type=int, default=d.block_size,
                   help=f"tokens per KV-cache block (default {d.block_size})")
    g.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks, help="KV blocks (default: from the memory budget)")
    g.add_argument("--kv-cache-mb", type=int, default=None,
                   help="KV cache memory budget when --num-kv-blocks is unset (default: see docs/scheduling.md)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--enable-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=d.seed, help="sampler seed for requests without their own")
    g.add_argument("--tbt-slo-ms", type=float, default=d.tbt_slo_ms,
                   help="sarathi: size each step to finish within this time-between-tokens target (ms); "
                        "--chunk-size stays the upper bound (docs/scheduling.md)")
    g.add_argument("--max-partial-prefills", type=int, default=d.max_partial_prefills,
                   help="chunked policies: prompts mid-prefill at once, sharing the prefill budget (default: no limit)")
    g.add_argument("--long-prefill-threshold", type=int, default=d.long_prefill_threshold,
                   help="prompts with more tokens left are long (default: 4%% of --max-model-len)")
    g.add_argument("--max-long-partial-prefills", type=int, default=d.max_long_partial_prefills,
                   help="long prompts mid-prefill at once (default 1)")
    g.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="split the model over this many rank processes (needs pip install 'minisarathi[mpi]')")
    g.add_argument("--rank-timeout-s", type=float, default=d.rank_timeout_s,
                   help=f"with --tensor-parallel-size: a step the ranks do not finish in this long stops them "
                        f"(default {d.rank_timeout_s:g})")
    g.add_argument("--priority-aging-s", type=float, default=d.priority_aging_s,
                   help=f"a request of priority p is queued as if it arrived p x this many seconds later "
                        f"(default {d.priority_aging_s:g})")
    g.add_argument("--blas-threads", type=int, default=d.blas_threads,
                   help="BLAS threads (default: the CPUs idle at start-up, at least 1)")
    g.add_argument("--no-overlap", dest="overlap", action="store_false", default=d.overlap,
                   help="run each step to the end before scheduling the next (default: the host schedules and "
                        "finishes outputs while the GPU computes, on the CUDA backend on a GPU)")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False, default=d.cuda_graphs,
                   help="run every step eagerly (default on the CUDA backends: decode steps as CUDA graphs)")


def engine_options_from_args(args: argparse.Namespace) -> dict:
    """LLMEngine's keyword arguments: every EngineConfig field that has a flag of the same name."""
    options = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    if args.model is not None and not Path(args.model).is_dir():
        why = "is not a folder" if Path(args.model).exists() else "does not exist"
        raise ValueError(f"{args.model_arg} {args.model}: {why} (give a Hugging Face model folder)")
    if args.kv_cache_mb is not None:
        if args.kv_cache_mb < 1:
            raise ValueError(f"--kv-cache-mb must be a positive number of MiB, got {args.kv_cache_mb}")
        options["kv_cache_bytes"] = args.kv_cache_mb << 20
    return dict(model=args.model, **options)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """Per-request sampling flags, named as SamplingParams' fields (--seed is the engine's, so --sample-seed)."""
    s = parser.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--sample-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")


def sampling_options_from_args(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def read_api_key(path: str | None) -> str | None:
    """The key in the file at `path` (surrounding whitespace stripped), else $MINISARATHI_API_KEY, else None;
    ValueError naming the flag or variable when it cannot be read or is empty."""
    if path:
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
        if not key:
            raise ValueError(f"--api-key-file {path}: the file is empty")
        return key
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"${API_KEY_ENV} is set but empty")
    return None if key is None else key.strip()


def port_number(text: str) -> int:
    """argparse type of a TCP port flag: an error naming the flag instead of a traceback at bind time."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port
