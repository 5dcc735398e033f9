"""Sampling on the device for the CUDA backend: minisarathi/sampler.py's rule, but the logits stay where
the model left them and only the sampled ids (and the requested logprobs) cross to the host.

Per row, in the same order as the NumPy Sampler:
1. min_tokens: stop and EOS ids set to -inf by one scatter into a copy of the logits.
2. Penalties: apply_penalties_kernel over the row's distinct prompt and output tokens (listed on the host,
   which knows them anyway); repetition, then frequency and presence, rounded as NumPy rounds them.
3. sample_kernel: argmax for temperature 0 (ties to the lowest id); otherwise min-p, top-k, top-p and an
   inverse CDF in token order with one uniform per row, drawn on the host from the same generators in the
   same order as the NumPy Sampler, so a seeded request picks what it would pick there. Large rows are
   split over several CTAs (`sample_plan`; docs/cuda.md, "Sampling").
4. Logprobs of the raw logits (before penalties) by array reductions on the device for the rows that ask.
5. The ids (and logprobs) start their copy to the host behind the sampling kernels; launch() returns without
   waiting, so the engine can issue the next step's forward (which reads the ids on the device) first.

    sampler = ops.new_sampler(vocab_size, seed, eos_token_ids)       # ops: a cuda_ops.CudaOps
    logits = model.forward(batch, cache, device_logits=True)
    out = sampler.sample(logits, params, generators, prompts, outputs)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minisarathi.backends.kernel_source import kernel_constants
from minisarathi.dtypes import convert, dtype_name
from minisarathi.sampler import (
    PendingSample,
    SamplerOutput,
    draw_uniforms,
    is_penalized,
    logit_bias_entries,
    make_generator,
    stop_token_indexes,
)
from minisarathi.sampling_params import SamplingParams

SAMPLING = kernel_constants("sampling.cu")  # SAMPLE_THREADS, SAMPLE_MAX_CHUNK, SAMPLE_PARAMS, RADIX_BINS
MAX_CTAS_PER_ROW = 8  # every CTA of a row reads every other's histogram per digit (8 KiB each)
# A split row costs up to 8 row barriers, about 1.5 us each on an H100-class GPU: about what one 1024-thread
# CTA spends on this many tokens over its ~9 passes (docs/performance.md; estimates until a GPU run). It is
# more than 7/8 of SAMPLE_MAX_CHUNK, so a row that fits in one CTA stays in one CTA.
SPLIT_COST_TOKENS = 32768


@dataclass(frozen=True)
class SamplePlan:
    """How sample_kernel covers a batch: groups of `ctas_per_row` CTAs, group g taking rows g, g + groups,
    ...; each CTA `chunk` tokens of its row (a multiple of 4, so 16-byte copies stay aligned)."""

    ctas_per_row: int
    groups: int
    chunk: int
    threads: int
    shared_bytes: int  # dynamic shared memory per CTA: its chunk of float32 logits
    workspace_words: int  # uint64: an arrival counter per group, then the exchange of split rows

    @property
    def grid(self) -> int:
        return self.groups * self.ctas_per_row


def sample_plan(rows: int, vocab: int, multiprocessors: int, ctas_per_row: int | None = None) -> SamplePlan:
    """The split with the least work on the slowest CTA: row iterations times (chunk + barrier cost), at most
    one CTA per SM so that the CTAs of a row are all resident when they wait for each other. A chunk must fit
    in shared memory (SAMPLE_MAX_CHUNK tokens); `ctas_per_row` forces a split (tests force small ones)."""
    fewest = math.ceil(vocab / SAMPLING["SAMPLE_MAX_CHUNK"])
    if fewest > multiprocessors:
        raise ValueError(
            f"vocab: {vocab} tokens need {fewest} CTAs per row, more than the {multiprocessors} SMs"
        )
    if ctas_per_row is not None and not fewest <= ctas_per_row <= multiprocessors:
        raise ValueError(
            f"ctas_per_row must be between {fewest} and {multiprocessors} for a {vocab}-token "
            f"vocabulary, got {ctas_per_row}"
        )

    def cost(c: int) -> int:
        iterations = math.ceil(rows / min(rows, multiprocessors // c))
        return iterations * (math.ceil(vocab / c) + (SPLIT_COST_TOKENS if c > 1 else 0))

    candidates = range(fewest, max(fewest, min(MAX_CTAS_PER_ROW, multiprocessors)) + 1)
    c = ctas_per_row or min(candidates, key=cost)  # min() keeps the first, smallest split among equals
    chunk = 4 * math.ceil(vocab / c / 4)
    groups = min(rows, multiprocessors // c)
    threads = max(32, min(SAMPLING["SAMPLE_THREADS"], 32 * math.ceil(chunk / 4 / 32)))
    exchange = 2 * c * SAMPLING["RADIX_BINS"] if c > 1 else 0
    return SamplePlan(c, groups, chunk, threads, 4 * chunk, groups * (1 + exchange))


def sample_parameters(temperature, top_k, top_p, min_p, uniform, vocab: int) -> np.ndarray:
    """float64[SAMPLE_PARAMS, N], sample_kernel's parameter rows: every value exact in double (float32
    parameters, integer top_k clipped to [-1, vocab])."""
    return np.stack(
        [
            np.asarray(temperature, np.float32),
            np.clip(np.asarray(top_k), -1, vocab),
            np.asarray(top_p, np.float32),
            np.asarray(min_p, np.float32),
            np.asarray(uniform, np.float64),
        ]
    ).astype(np.float64)


def launch_sample(kernel, launcher, allow_shared_mem, logits, params, plan: SamplePlan, ids) -> None:
    """One sample_kernel launch over contiguous float32 logits[N, V] with device `params` (sample_parameters),
    writing int32 ids[N] on the device. allow_shared_mem(kernel, nbytes): CudaOps._allow_shared_mem, the
    opt-in for the chunk's dynamic shared memory on top of the kernel's ~17 KiB of static scratch."""
    rows, vocab = logits.shape
    allow_shared_mem(kernel, plan.shared_bytes)
    kernel(
        (plan.grid,),
        (plan.threads,),
        (
            logits,
            np.int32(rows),
            np.int32(vocab),
            params,
            np.int32(plan.ctas_per_row),
            np.int32(plan.chunk),
            launcher.xp.zeros(plan.workspace_words, dtype=np.uint64),
            ids,
        ),
        shared_mem=plan.shared_bytes,
    )


def sample_rows(
    kernel,
    launcher,
    allow_shared_mem,
    logits,
    temperature,
    top_k,
    top_p,
    min_p,
    uniform,
    ctas_per_row: int | None = None,
):
    """Device int32[N] ids from sample_kernel (`kernel`, through `launcher`, opted in to its shared memory by
    `allow_shared_mem`) over float32 logits[N, V] with per-row parameters and uniform[N] in [0, 1) drawn on
    the host: one upload of the parameters, one launch."""
    xp = launcher.xp
    logits = xp.ascontiguousarray(logits, dtype=np.float32)
    rows, vocab = logits.shape
    ids = xp.empty((rows,), dtype=np.int32)
    if rows:
        params = launcher.to_device(sample_parameters(temperature, top_k, top_p, min_p, uniform, vocab))
        launch_sample(
            kernel,
            launcher,
            allow_shared_mem,
            logits,
            params,
            sample_plan(rows, vocab, launcher.multiprocessors, ctas_per_row),
            ids,
        )
    return ids


class GpuSampler:
    def __init__(
        self,
        ops,
        vocab_size: int,
        seed: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        ctas_per_row: int | None = None,
    ):
        self.ops = ops
        self.ctas_per_row = ctas_per_row  # None: sample_plan's choice; tests force splits
        self.xp = ops.xp
        self.vocab_size = vocab_size
        self._eos_array = np.array(
            eos_token_ids, np.int64
        )  # int64[E]: masked while min_tokens is not reached
        self._rng = make_generator(seed)  # for the rows without a seed of their own

    def sample(
        self,
        logits,
        params: list[SamplingParams],
        generators: list[np.random.Generator | None],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
    ) -> SamplerOutput:
        """As Sampler.sample, with `logits` a device array [N, vocab] in float32 or the activation dtype."""
        return self.launch(logits, params, generators, prompt_ids, output_ids).result()

    def launch(
        self,
        logits,
        params: list[SamplingParams],
        generators: list[np.random.Generator | None],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
    ) -> PendingSample:
        """sample() without waiting: the kernels and the ids' copy to the host are queued; the ids stay on the
        device for the next forward, and result() waits only for this sampling, not for work queued after
        it."""
        n = len(params)
        if logits.ndim != 2 or logits.shape != (n, self.vocab_size):
            raise ValueError(f"logits must have shape ({n}, {self.vocab_size}), got {logits.shape}")
        if not len(generators) == len(prompt_ids) == len(output_ids) == n:
            raise ValueError("generators, prompt_ids and output_ids must have one entry per row of logits")
        logits = self.xp.ascontiguousarray(convert(logits, dtype_name(logits), "float32"))  # float32[N, V]
        edited = any(len(o) < p.min_tokens or p.logit_bias for p, o in zip(params, output_ids)) or any(
            map(is_penalized, params)
        )
        x = logits.copy() if edited else logits  # the raw logits stay for the logprobs
        self._mask_stop_tokens(x, params, output_ids)
        flat, bias = logit_bias_entries(params, self.vocab_size)
        if flat.size:
            to_device = self.ops.launcher.to_device
            x.reshape(-1)[to_device(flat)] += to_device(bias)
        self._apply_penalties(x, params, prompt_ids, output_ids)

        temperature = np.array([p.temperature for p in params], np.float32)
        greedy = temperature == 0
        if greedy.all():
            token_ids = self.ops.greedy(x)  # device int32[N]
        else:
            token_ids = self.ops.sample(
                x,
                temperature,
                [p.top_k for p in params],
                [p.top_p for p in params],
                [p.min_p for p in params],
                self._uniforms(np.flatnonzero(~greedy), generators, n),
                self.ctas_per_row,
            )
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        k = min(max((params[i].logprobs for i in rows), default=0), self.vocab_size)
        wait = self.ops.launcher.to_host_async(
            [token_ids, *self._logprobs_on_device(logits, token_ids, rows, k)]
        )
        return PendingSample(token_ids, lambda: self._output(params, rows, wait()))

    def apply_token_bitmask(self, logits, rows: np.ndarray, bitmask: np.ndarray):
        """Structured outputs (minisarathi/structured.py): a float32 copy of the device logits [N, V] with the
        tokens host int32 bitmask[i] clears in row rows[i] (int64[R]) at -inf, by one kernel on the device."""
        x = self.xp.array(convert(logits, dtype_name(logits), "float32"), order="C")  # a copy, float32[N, V]
        to_device = self.ops.launcher.to_device
        self.ops.apply_token_bitmask(x, to_device(rows.astype(np.int64)), to_device(bitmask.view(np.uint32)))
        return x

    def _mask_stop_tokens(self, x, params, output_ids) -> None:
        flat = stop_token_indexes(params, output_ids, self._eos_array, self.vocab_size)
        if flat.size:
            x.reshape(-1)[self.ops.launcher.to_device(flat)] = -np.inf

    def _apply_penalties(self, x, params, prompt_ids, output_ids) -> None:
        if not any(map(is_penalized, params)):
            return
        tokens, counts = [], []  # per row: distinct prompt and output ids, and their counts in the output
        for p, prompt, output in zip(params, prompt_ids, output_ids):
            if not is_penalized(p):
                prompt = output = []
            seen, where = np.unique(np.array([*prompt, *output], np.int64), return_inverse=True)
            tokens.append(seen)
            counts.append(np.bincount(where[len(prompt) :], minlength=len(seen)))
        self.ops.apply_penalties(
            x,
            tokens,
            counts,
            [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params],
            [p.presence_penalty for p in params],
        )

    def _uniforms(self, rows: np.ndarray, generators, n: int) -> np.ndarray:
        """float64[n]: the draws of the non-greedy rows, made as Sampler makes them; 0 for greedy rows."""
        uniform = np.zeros(n)
        uniform[rows] = draw_uniforms(self._rng, [generators[i] for i in rows])
        return uniform

    def _logprobs_on_device(self, logits, token_ids, rows: list[int], k: int) -> list:
        """Device arrays of the rows asking for logprobs: the log-sum-exp of the raw logits (float64[R]), the
        sampled token's raw logit and rank, and the top k ids (int64[R, k]) with their raw logits."""
        if not rows:
            return []
        xp, to_device = self.xp, self.ops.launcher.to_device
        rows_on_device = to_device(np.array(rows, np.int64))
        raw = logits[rows_on_device]  # float32[R, V]
        top_raw = raw.max(axis=1)
        # log-softmax = raw - logsumexp(raw), the sum in float64 as the NumPy Sampler does it
        lse = top_raw + xp.log(xp.exp(raw - top_raw[:, None]).sum(axis=1, dtype=np.float64))  # float64[R]
        sampled_raw = xp.take_along_axis(raw, token_ids[rows_on_device].astype(np.int64)[:, None], axis=1)[
            :, 0
        ]
        row_ranks = 1 + (raw > sampled_raw[:, None]).sum(axis=1)
        # Rank order, equal logits by lowest id: a stable sort (CuPy's always is; older CuPy has no `kind`).
        order = np.argsort(-raw, axis=1, kind="stable") if xp is np else xp.argsort(-raw, axis=1)
        top = order[:, :k]  # int64[R, k]
        return [lse, sampled_raw, row_ranks, top, xp.take_along_axis(raw, top, axis=1)]

    @staticmethod
    def _output(params, rows: list[int], host: list[np.ndarray]) -> SamplerOutput:
        """The SamplerOutput from the host copies of launch()'s device arrays."""
        token_ids = host[0].astype(np.int64)
        n = len(params)
        logprobs, ranks = [None] * n, [None] * n
        if rows:
            lse, sampled_raw, row_ranks, top_ids, top_raw_values = host[1:]
            for j, i in enumerate(rows):
                chosen = [(int(token_ids[i]), float(sampled_raw[j]))]
                chosen += [
                    (int(t), float(v))
                    for t, v in zip(top_ids[j, : params[i].logprobs], top_raw_values[j, : params[i].logprobs])
                ]
                logprobs[i] = [(t, v - float(lse[j])) for t, v in chosen]
                ranks[i] = int(row_ranks[j])
        return SamplerOutput(token_ids, logprobs, ranks)
