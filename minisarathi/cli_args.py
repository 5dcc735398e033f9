"""The command-line flags that several commands share (engine options, sampling, the API key), built from the
dataclasses they fill so a field's flag, default and meaning are written once; the help formatter, and the
check that refuses a flag that would not take effect. Imports none of the commands."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields
from pathlib import Path

from minisarathi.config import DEVICES, ENGINE_DTYPES, SCHEDULERS, EngineConfig
from minisarathi.quant.gguf_file import is_gguf

API_KEY_ENV = "MINISARATHI_API_KEY"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help ends with its default, unless the help says it in words or there is none (unset,
    off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, [], argparse.SUPPRESS) or action.default is False:
            return text
        return super()._get_help_string(action)


# Flags whose destination is not their name with underscores for dashes.
_DESTS = {
    "MODEL": "model",
    "--model": "model_flag",
    "--no-overlap": "overlap",
    "--no-cuda-graphs": "cuda_graphs",
}


def given(parser: argparse.ArgumentParser, args: argparse.Namespace, flag: str) -> bool:
    """Whether the command line set `flag` (or the positional MODEL) to something other than its default."""
    dest = _DESTS.get(flag, flag.lstrip("-").replace("-", "_"))
    return getattr(args, dest) != parser.get_default(dest)


def refuse_unneeded(
    parser: argparse.ArgumentParser, args: argparse.Namespace, rules: list[tuple[str, bool, str]]
) -> None:
    """ValueError for the first flag of `rules` (flag, whether it takes effect, why not) that the command line
    gives where it would not take effect: a flag is refused, never silently ignored."""
    for flag, takes_effect, why_not in rules:
        if not takes_effect and given(parser, args, flag):
            raise ValueError(f"{flag} {why_not}")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model (MODEL or --model) and the engine options, named as EngineConfig's fields (chunk_size ->
    --chunk-size)."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Hugging Face model folder (default: the bundled stories260K)",
    )
    d = EngineConfig()  # the defaults live in one place
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        metavar="MODEL",
        help="the same as MODEL (give one of them)",
    )
    g.add_argument("--device", choices=DEVICES, default=d.device, help="compute backend")
    g.add_argument(
        "--dtype",
        choices=ENGINE_DTYPES,
        default=d.dtype,
        help="CUDA backends' compute dtype; on the CPU the weights' dtype, activations staying float32 "
        "(default auto: the checkpoint's; float32 for an exact emulation against the CPU)",
    )
    g.add_argument("--scheduler", choices=SCHEDULERS, default=d.scheduler, help="batching policy")
    g.add_argument("--chunk-size", type=int, default=d.chunk_size, help="per-iteration token budget")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block")
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=d.num_kv_blocks,
        help="KV blocks (default: from the memory budget)",
    )
    g.add_argument(
        "--kv-cache-mb",
        type=int,
        default=None,
        help="KV cache memory budget when --num-kv-blocks is unset (default: see docs/scheduling.md)",
    )
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences in one batch at most")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="longest prompt + output in tokens (default: the model's max_position_embeddings)",
    )
    g.add_argument(
        "--enable-prefix-caching", action="store_true", help="share the KV blocks of common prefixes"
    )
    g.add_argument("--seed", type=int, default=d.seed, help="sampler seed for requests without their own")
    g.add_argument(
        "--tbt-slo-ms",
        type=float,
        default=d.tbt_slo_ms,
        help="sarathi: size each step to finish within this time-between-tokens target (ms); "
        "--chunk-size stays the upper bound (docs/scheduling.md)",
    )
    g.add_argument(
        "--max-partial-prefills",
        type=int,
        default=d.max_partial_prefills,
        help="chunked policies: prompts mid-prefill at once, sharing the prefill budget (default: no limit)",
    )
    g.add_argument(
        "--long-prefill-threshold",
        type=int,
        default=d.long_prefill_threshold,
        help="prompts with more tokens left are long (default: 4%% of --max-model-len)",
    )
    g.add_argument(
        "--max-long-partial-prefills",
        type=int,
        default=d.max_long_partial_prefills,
        help="long prompts mid-prefill at once (default 1)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=d.tensor_parallel_size,
        help="split the model over this many rank processes (needs pip install 'minisarathi[mpi]')",
    )
    g.add_argument(
        "--rank-timeout-s",
        type=float,
        default=d.rank_timeout_s,
        help=f"with --tensor-parallel-size: a step the ranks do not finish in this long stops "
        f"them (default {d.rank_timeout_s:g})",
    )
    g.add_argument(
        "--priority-aging-s",
        type=float,
        default=d.priority_aging_s,
        help=f"a request of priority p is queued as if it arrived p x this many seconds later "
        f"(default {d.priority_aging_s:g})",
    )
    g.add_argument(
        "--blas-threads",
        type=int,
        default=d.blas_threads,
        help="BLAS threads (default: the CPUs idle at start-up, at least 1)",
    )
    g.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        default=d.overlap,
        help="run each step to the end before scheduling the next (default: the host schedules "
        "and finishes outputs while the GPU computes, on the CUDA backend on a GPU)",
    )
    g.add_argument(
        "--speculative-config",
        type=json_object,
        default=d.speculative_config,
        metavar="JSON",
        help='vLLM\'s, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\': '
        "draft tokens verified within each step's budget (docs/scheduling.md)",
    )
    g.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_const",
        const=False,
        default=d.cuda_graphs,
        help="run every step eagerly (default on the CUDA backends: decode steps as CUDA graphs)",
    )


def json_object(text: str) -> dict:
    """argparse type of a JSON-object flag: an error naming the flag instead of a traceback."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def check_engine_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses engine flags that would not take effect (EngineConfig checks the pairs the API refuses too)."""
    model_folder(args)
    refuse_unneeded(
        parser,
        args,
        [
            ("--kv-cache-mb", args.num_kv_blocks is None, "sizes the cache only without --num-kv-blocks"),
            ("--rank-timeout-s", args.tensor_parallel_size > 1, "needs --tensor-parallel-size above 1"),
        ],
    )


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The model and engine flags that add_engine_arguments added to `args`' parser."""
    flags = {dest: flag for flag, dest in _DESTS.items()}
    return [
        "MODEL",
        "--model",
        "--kv-cache-mb",
        *(
            flags.get(f.name, "--" + f.name.replace("_", "-"))
            for f in fields(EngineConfig)
            if hasattr(args, f.name)
        ),
    ]


def model_folder(args: argparse.Namespace) -> tuple[str | None, str]:
    """The model folder given as MODEL or --model (None: the bundled one) and the name it was given by;
    ValueError when the two name different folders."""
    both = args.model is not None and args.model_flag is not None
    if both and Path(args.model).resolve() != Path(args.model_flag).resolve():
        raise ValueError(f"MODEL {args.model} and --model {args.model_flag}: give the model once")
    if args.model_flag is not None:
        return args.model_flag, "--model"
    return args.model, "MODEL"


def engine_options_from_args(args: argparse.Namespace) -> dict:
    """LLMEngine's keyword arguments: the model folder and every EngineConfig field that has a flag of the
    same name."""
    options = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    model, named = model_folder(args)
    if model is not None and not Path(model).is_dir() and not is_gguf(model):
        why = "is neither a folder nor a GGUF file" if Path(model).exists() else "does not exist"
        raise ValueError(f"{named} {model}: {why} (give a Hugging Face model folder or a .gguf file)")
    if args.kv_cache_mb is not None:
        if args.kv_cache_mb < 1:
            raise ValueError(f"--kv-cache-mb must be a positive number of MiB, got {args.kv_cache_mb}")
        options["kv_cache_bytes"] = args.kv_cache_mb << 20
    return dict(model=model, **options)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """Per-request sampling flags, named as SamplingParams' fields (--seed is the engine's, so --sample-seed).
    Two defaults differ from SamplingParams' and the server's (max_tokens 16, temperature 1.0): the help says
    so."""
    s = parser.add_argument_group("sampling")
    s.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="tokens to generate at most (default 64; SamplingParams and the server: 16)",
    )
    s.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 samples greedily (default 0; SamplingParams and the server: 1.0)",
    )
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this share of the mass")
    s.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the likeliest")
    s.add_argument("--sample-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")


def check_sampling_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Greedy sampling (temperature 0, the default here) reads none of the sampling knobs: they are
    refused."""
    sampled = args.temperature > 0
    refuse_unneeded(
        parser,
        args,
        [
            (flag, sampled, "needs --temperature above 0 (0 samples greedily)")
            for flag in ("--top-p", "--top-k", "--min-p", "--sample-seed")
        ],
    )


def sampling_options_from_args(args: argparse.Namespace) -> dict:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sample_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def read_api_key(path: str | None) -> str | None:
    """The key in the file at `path` (surrounding whitespace stripped), else $MINISARATHI_API_KEY, else None;
    ValueError naming the flag or variable when it cannot be read or is empty."""
    if path:
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or e
            raise ValueError(f"--api-key-file {path}: cannot be read ({reason})") from None
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
