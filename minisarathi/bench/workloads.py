"""Seeded synthetic workloads in Sarathi-Serve's shape: request lengths x arrival times x token-id prompts.

Lengths: fixed, uniform or zipf over total tokens split by a prefill:decode ratio, or rows of a trace CSV
(num_prefill_tokens, num_decode_tokens). Arrivals: Poisson (inter-arrival clipped at 3x the mean), gamma
with a given coefficient of variation, all at once (static), or a trace CSV column `arrived_at` (seconds).
Prompts are random token ids; the decode length is forced (ignore EOS, max_tokens = decode length).
Optionally a share of the requests gets prompts `long_factor` x the median prompt (head-of-line blocking),
and a share gets priority 0 while the others get 1; such requests are tagged with a group ("long" /
"short", "high" / "low") that the metrics are also broken down by.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LENGTHS = ("fixed", "uniform", "zipf", "trace")
ARRIVALS = ("poisson", "gamma", "static", "trace")
SHAREGPT_TRACE = Path(__file__).resolve().parent / "data" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
FIRST_PROMPT_TOKEN = 3  # skip <unk>, <s>, </s>: synthetic prompts are plain tokens


@dataclass
class WorkloadConfig:
    num_requests: int = 64
    lengths: str = "trace"
    prompt_len: int = 128  # fixed
    decode_len: int = 32  # fixed
    min_total_tokens: int = (
        64  # uniform, zipf: prompt + output tokens in [min_total_tokens, max_total_tokens]
    )
    max_total_tokens: int = 512
    pd_ratio: float = 4.0  # uniform, zipf: prefill tokens / decode tokens
    zipf_theta: float = 0.6  # zipf: P(total = min_total_tokens + k - 1) ~ k^-theta
    trace: str | None = None  # trace CSV; None: the bundled ShareGPT trace
    trace_scale: float = 1.0  # multiplies both parts of every trace row before the max-length cut
    max_model_len: int = 4096  # rows longer than this are scaled down proportionally
    arrivals: str = "poisson"
    qps: float = 1.0  # poisson, gamma: mean requests per second
    cv: float = 2.0  # gamma: coefficient of variation of inter-arrival times
    arrival_trace: str | None = None  # trace: CSV with an `arrived_at` column (seconds)
    vocab_size: int = 512
    long_fraction: float = 0.0  # this share of the requests get prompts long_factor x the median prompt
    long_factor: float = 16.0
    high_priority_fraction: float = (
        0.0  # this share get priority 0, the others 1 (0: every request priority 0)
    )
    seed: int = 0

    def __post_init__(self):
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {', '.join(LENGTHS)}, got {self.lengths!r}")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        for name in (
            "num_requests",
            "prompt_len",
            "decode_len",
            "min_total_tokens",
            "max_total_tokens",
            "max_model_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (a prompt and an output token), got {self.max_model_len}"
            )
        if self.min_total_tokens > self.max_total_tokens:
            raise ValueError(
                f"min_total_tokens ({self.min_total_tokens}) must be <= max_total_tokens "
                f"({self.max_total_tokens})"
            )
        if self.min_total_tokens < 2:
            raise ValueError(
                f"min_total_tokens must be >= 2 (a prompt and an output token), got {self.min_total_tokens}"
            )
        for name in ("pd_ratio", "trace_scale", "qps", "cv"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.zipf_theta < 0:
            raise ValueError(f"zipf_theta must be >= 0, got {self.zipf_theta}")
        for name in ("long_fraction", "high_priority_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        if (
            isinstance(self.long_factor, bool)
            or not isinstance(self.long_factor, (int, float))
            or not self.long_factor >= 1
        ):
            raise ValueError(f"long_factor must be a number >= 1, got {self.long_factor!r}")
        if self.vocab_size <= FIRST_PROMPT_TOKEN:
            raise ValueError(f"vocab_size must be > {FIRST_PROMPT_TOKEN}, got {self.vocab_size}")
        if self.arrivals == "trace" and not self.arrival_trace:
            raise ValueError(
                "arrival_trace must name a CSV with an arrived_at column when arrivals is 'trace'"
            )


@dataclass
class RequestSpec:
    request_id: str
    arrival_time: float  # seconds after the run starts
    prompt_token_ids: list[int]
    max_tokens: int  # forced decode length
    priority: int = 0
    group: str = ""  # "long" / "short", "high" / "low" (joined by "+"), or "" when untagged


def make_workload(cfg: WorkloadConfig) -> list[RequestSpec]:
    """The same config always gives the same requests; lengths, arrivals, prompts, long prompts and priorities
    draw from separate streams."""
    lengths_rng, arrivals_rng, prompts_rng, long_rng, priority_rng = (
        np.random.default_rng([cfg.seed, i]) for i in range(5)
    )
    prompt_lens, decode_lens = request_lengths(cfg, lengths_rng)
    groups = [[] for _ in range(cfg.num_requests)]
    if cfg.long_fraction > 0:
        long = long_rng.random(cfg.num_requests) < cfg.long_fraction
        prompt_lens = np.where(long, np.round(cfg.long_factor * np.median(prompt_lens)), prompt_lens)
        prompt_lens, decode_lens = fit_to_max_len(prompt_lens, decode_lens, cfg.max_model_len)
        for g, is_long in zip(groups, long):
            g.append("long" if is_long else "short")
    priorities = np.zeros(cfg.num_requests, dtype=np.int64)
    if cfg.high_priority_fraction > 0:
        priorities = (priority_rng.random(cfg.num_requests) >= cfg.high_priority_fraction).astype(np.int64)
        for g, priority in zip(groups, priorities):
            g.append("low" if priority else "high")
    arrivals = arrival_times(cfg, arrivals_rng)
    return [
        RequestSpec(
            f"req-{i}",
            float(arrivals[i]),
            prompts_rng.integers(FIRST_PROMPT_TOKEN, cfg.vocab_size, int(prompt_lens[i])).tolist(),
            int(decode_lens[i]),
            int(priorities[i]),
            "+".join(groups[i]),
        )
        for i in range(cfg.num_requests)
    ]


def request_lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, decode lengths), int64[num_requests] each, every part >= 1 and total <=
    max_model_len."""
    n = cfg.num_requests
    if cfg.lengths == "fixed":
        prompt, decode = np.full(n, cfg.prompt_len), np.full(n, cfg.decode_len)
        return fit_to_max_len(prompt, decode, cfg.max_model_len)
    if cfg.lengths == "trace":
        prompt, decode = read_trace_lengths(cfg.trace or SHAREGPT_TRACE)
        order = rng.permutation(len(prompt))
        # Cycle through the shuffled rows when more requests than rows are asked for.
        rows = order[np.arange(n) % len(order)]
        prompt = np.maximum(np.round(prompt[rows] * cfg.trace_scale), 1).astype(np.int64)
        decode = np.maximum(np.round(decode[rows] * cfg.trace_scale), 1).astype(np.int64)
        return fit_to_max_len(prompt, decode, cfg.max_model_len)
    if cfg.lengths == "uniform":
        total = rng.integers(cfg.min_total_tokens, cfg.max_total_tokens + 1, n)
    else:
        num_values = cfg.max_total_tokens - cfg.min_total_tokens + 1
        total = cfg.min_total_tokens + zipf_ranks(num_values, cfg.zipf_theta, n, rng) - 1
    # Sarathi-Serve's split: decode = total / (1 + P:D), prefill the rest.
    decode = np.clip(np.round(total / (1 + cfg.pd_ratio)), 1, total - 1).astype(np.int64)
    return fit_to_max_len(total - decode, decode, cfg.max_model_len)


def zipf_ranks(num_values: int, theta: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Ranks 1..num_values drawn with P(k) proportional to k^-theta (bounded zipf), int64[size]."""
    weights = np.arange(1, num_values + 1, dtype=np.float64) ** -theta
    return rng.choice(num_values, size=size, p=weights / weights.sum()) + 1


def fit_to_max_len(prompt: np.ndarray, decode: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Scale rows whose total exceeds max_len down proportionally (Sarathi-Serve's rule), each part >= 1."""
    prompt, decode = prompt.astype(np.int64), decode.astype(np.int64)
    total = prompt + decode
    excess = np.maximum(total - max_len, 0)
    prompt = np.clip(prompt - np.ceil(excess * prompt / total).astype(np.int64), 1, max_len - 1)
    # Keeping a part at 1 can push the total one over; the other part gives way.
    decode = np.clip(decode - np.ceil(excess * decode / total).astype(np.int64), 1, max_len - prompt)
    return prompt, decode


def read_trace_lengths(path) -> tuple[np.ndarray, np.ndarray]:
    columns = _read_csv_columns(path, ("num_prefill_tokens", "num_decode_tokens"), "trace")
    prompt, decode = (np.asarray(c, dtype=np.float64) for c in columns)
    if len(prompt) == 0 or (prompt < 1).any() or (decode < 1).any():
        raise ValueError(f"trace {path}: needs rows with num_prefill_tokens and num_decode_tokens >= 1")
    return prompt, decode


def arrival_times(cfg: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    """Seconds after the start, float64[num_requests], non-decreasing, the first at 0."""
    n = cfg.num_requests
    mean = 1.0 / cfg.qps
    if cfg.arrivals == "static":
        return np.zeros(n)
    if cfg.arrivals == "poisson":
        gaps = np.minimum(rng.exponential(mean, n - 1), 3 * mean)
    elif cfg.arrivals == "gamma":
        shape = 1.0 / cfg.cv**2
        gaps = rng.gamma(shape, mean / shape, n - 1)
    else:
        (times,) = _read_csv_columns(cfg.arrival_trace, ("arrived_at",), "arrival_trace")
        times = np.asarray(times, dtype=np.float64)
        if len(times) < n:
            raise ValueError(f"arrival_trace {cfg.arrival_trace}: {len(times)} rows, {n} requests asked for")
        times = np.sort(times[:n])
        return times - times[0]
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _read_csv_columns(path, names: tuple[str, ...], field: str) -> list[list[float]]:
    """The named columns of the CSV file at `path`; ValueError naming `field` (the config field that gave the
    path), the file and the rule."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [n for n in names if n not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{field} {path}: missing column(s) {', '.join(missing)}")
            columns = [[] for _ in names]
            for row in reader:
                for column, name in zip(columns, names):
                    try:
                        column.append(float(row[name]))
                    except (TypeError, ValueError):
                        raise ValueError(
                            f"{field} {path}, line {reader.line_num}: {name} must be a number, "
                            f"got {row[name]!r}"
                        ) from None
    except OSError as e:
        raise ValueError(f"{field} {path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{field} {path}: not a UTF-8 CSV file") from None
    return columns
