"""tbt_slo_ms mode's start-up profile: a handful of synthetic steps of chosen shapes, timed on the engine's
own model, KV cache and sampler before any request arrives, so that the cost model has a fit from the first
step (CostModel.add_profile). The cheap shapes that determine the fit run first and whatever the time
limit: on a slow model (quantized, 2 cores) the limit used to stop the profile before the fit was determined,
and the steps ran the fixed chunk_size budget (multi-second prefills). It writes garbage K/V into the pool's
blocks, which is harmless only while no sequence holds any: the engine runs it in its constructor.
"""

from __future__ import annotations

import time

import numpy as np

from minisarathi.batch import make_batch
from minisarathi.engine.cost_model import StepShape
from minisarathi.sampling_params import SamplingParams

PROFILE_SECONDS = 3.0  # past the DETERMINING shapes, none starts that is expected to end past this
DETERMINING = 6  # the plan's first shapes, which always run: more rows than the cost model's 5 coefficients
MAX_PROFILE_TOKENS = 512  # the largest prefill chunk profiled: the fit extrapolates beyond it
MAX_PROFILE_SEQS = 32  # the largest decode batch profiled
PROFILE_PASSES = 2  # each shape timed twice: one sample of a step is noisy on a shared machine


def profile_plan(token_budget: int, max_context: int, max_seqs: int) -> list[list[tuple[int, int]]]:
    """Steps as lists of (start position, tokens) chunks. A chunk of one token is a decode over start + 1
    tokens; the others are prefills. The first DETERMINING shapes are cheap and vary every feature of the cost
    model independently: one decode over a short and over a long history, many decodes, a small prefill from
    position 0 and one late in a long context; then the costly ones: a hybrid step and full chunks."""
    tokens = max(2, min(token_budget, max_context, MAX_PROFILE_TOKENS))
    seqs = max(1, min(max_seqs, MAX_PROFILE_SEQS))
    short, long, small = max(1, max_context // 8), max_context, max(2, tokens // 8)
    return [
        [(short - 1, 1)],
        [(long - 1, 1)],
        [(short - 1, 1)] * seqs,
        [(0, small)],
        [(max(0, max_context - small), small)],
        [(long - 1, 1)] * seqs,
        [(0, max(2, tokens // 2))] + [(max_context // 2 - 1, 1)] * max(1, seqs // 2),
        [(0, tokens)],
        [(max(0, max_context - tokens), tokens)],
    ]


def run_profile(
    model,
    kv_cache,
    sampler,
    block_size: int,
    num_blocks: int,
    token_budget: int,
    max_model_len: int,
    max_seqs: int,
) -> tuple[list[StepShape], list[float]]:
    """(the shapes, their measured seconds: forward + greedy sampling). Every chunk uses the same block table:
    only the amount of work matters, not what the K/V hold."""
    max_context = min(max_model_len, num_blocks * block_size)
    table = np.arange(-(-max_context // block_size), dtype=np.int32)
    greedy = SamplingParams(temperature=0.0)
    plan = profile_plan(token_budget, max_context, max_seqs)

    def run(step: list[tuple[int, int]]) -> float:
        rows = len(step)
        began = time.perf_counter()
        batch = make_batch(
            [1] * sum(n for _, n in step),
            [start for start, _ in step],
            [n for _, n in step],
            np.tile(table, (rows, 1)),
            [True] * rows,
            block_size,
        )
        logits = model.forward(batch, kv_cache, device_logits=True)
        sampler.sample(logits, [greedy] * rows, [None] * rows, [[1]] * rows, [[]] * rows)
        return time.perf_counter() - began

    run(plan[1])  # first calls allocate and warm caches: not a step's cost
    shapes, seconds = [], []
    began = time.perf_counter()
    for i, step in enumerate(plan * PROFILE_PASSES):
        # a shape is expected to take what it took in the first pass, or, in the first pass, at least what the
        # previous (cheaper) one took: one long shape must not overrun the limit by seconds
        expected = seconds[i - len(plan)] if i >= len(plan) else (seconds[-1] if seconds else 0.0)
        if i >= DETERMINING and time.perf_counter() - began + expected > PROFILE_SECONDS:
            break
        shape = StepShape()
        for start, n in step:
            if n == 1:
                shape.add_decode(start + 1)
            else:
                shape.add_prefill(start, n)
        seconds.append(run(step))
        shapes.append(shape)
    return shapes, seconds
