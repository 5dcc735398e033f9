"""Offline generation and embeddings, vLLM style: LLM(model).generate(prompts, sampling_params) and
.embed(prompts, pooling_params) over an LLMEngine."""

from __future__ import annotations

import itertools
from numbers import Integral
from pathlib import Path

from minisarathi.engine.engine import LLMEngine
from minisarathi.model.pooling import PoolingParams
from minisarathi.outputs import RequestOutput
from minisarathi.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | Path | None = None, **options):
        """model: a Hugging Face folder (None: the bundled stories260K); options: EngineConfig fields."""
        self.engine = LLMEngine(model, **options)
        self._request_ids = itertools.count()

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: int | list[int] = 0,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in prompt order. Every prompt is checked before any runs.
        priority: one for all prompts or one per prompt; lower runs first."""
        return self._run(prompts, sampling_params, use_tqdm, priority, "sampling_params")

    def embed(
        self,
        prompts: str | list[int] | list[str | list[int]],
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        use_tqdm: bool = False,
        priority: int | list[int] = 0,
    ) -> list[RequestOutput]:
        """vLLM's LLM.embed: one finished RequestOutput per prompt, in prompt order, whose `embedding` is its
        last token's hidden state after the final norm, L2-normalised (model/pooling.py)."""
        if not isinstance(pooling_params, (list, tuple)):
            pooling_params = pooling_params or PoolingParams()
        return self._run(prompts, pooling_params, use_tqdm, priority, "pooling_params")

    def _run(self, prompts, params, use_tqdm: bool, priority, params_name: str) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list)
            and prompts
            and all(type(t) is int or isinstance(t, Integral) for t in prompts)
        ):
            prompts = [prompts]  # one prompt: a text or a list of token ids
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a str, a list of token ids, or a list of those")
        if not isinstance(params, (list, tuple)):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{params_name}: got {len(params)} for {len(prompts)} prompts")
        if not isinstance(priority, (list, tuple)):
            priority = [priority] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} for {len(prompts)} prompts")
        seqs = [
            self.engine.prepare_request(str(next(self._request_ids)), prompt, p, stream=False, priority=rank)
            for prompt, p, rank in zip(prompts, params, priority)
        ]
        for seq in seqs:
            self.engine.add_sequence(seq)
        finished = {}
        progress = _progress_bar(len(seqs)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [finished[seq.request_id] for seq in seqs]


def _progress_bar(total: int):
    try:
        from tqdm import tqdm  # optional: not a dependency
    except ImportError:
        return None
    return tqdm(total=total, desc="Generating", unit="req")
