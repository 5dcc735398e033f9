"""Picks the next token of every sampling row of a batch from its logits, vectorized over the rows.

Per row, in vLLM's order:
1. min_tokens: the stop token ids and the EOS ids (unless ignore_eos) get -inf until min_tokens are out;
   then logit_bias is added to its token ids' logits.
2. Penalties on the logits: repetition (tokens seen in the prompt or the output: positive logits divided
   by the penalty, negative ones multiplied), then frequency (times the token's count in the output) and
   presence (once if it is in the output) subtracted, OpenAI style.
3. temperature 0: argmax (ties go to the lowest id). Otherwise softmax(logits / temperature) in float32
   (sums and CDFs in float64), then min-p (drop tokens below min_p times the top probability), top-k,
   then top-p (the smallest set of most likely tokens, in the top-k set renormalized, whose mass reaches
   top_p).
4. One uniform draw per non-greedy row, from the request's own generator when it has a seed (so its
   tokens do not depend on what else is in the batch) or from the sampler's generator otherwise, mapped
   through the inverse CDF of the kept probabilities renormalized (in token id order); that search runs in one
   native call where it can be built (minisarathi/backends/cpu/native_sampling.py), with the same tokens.

Logprobs are the log-softmax of the raw logits, before penalties and temperature (vLLM's "raw_logprobs").
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable

import numpy as np

from minisarathi.backends.cpu import native_sampling
from minisarathi.sampling_params import SamplingParams

_NUCLEUS_CANDIDATES = 1024  # most likely tokens searched for the top-p nucleus before a full sort


def make_generator(seed: int) -> np.random.Generator:
    """The generator a seeded request owns for its whole life (kept across preemptions)."""
    return np.random.Generator(np.random.PCG64(seed))


# The rule shared with the CUDA backend's GpuSampler (minisarathi/backends/gpu_sampling.py), which must pick
# the same tokens: which ids are masked, which rows are penalized, and the order of the uniform draws.


def stop_token_indexes(
    params: list[SamplingParams], output_ids: list[list[int]], eos_token_ids: np.ndarray, vocab_size: int
) -> np.ndarray:
    """int64[M] flat indexes row * vocab_size + id of the ids each row may not sample yet: its stop ids and
    (unless ignore_eos) the EOS ids (int64[E]), while fewer than min_tokens tokens are out. Ids beyond the
    vocabulary are left out: they can never be sampled. Built from each request's stop_token_array with seven
    array calls per step, whatever the batch (a loop over rows and ids cost ~0.3 ms of a 33-request step)."""
    rows = [i for i, (p, out) in enumerate(zip(params, output_ids)) if len(out) < p.min_tokens]
    if not rows:
        return np.empty(0, np.int64)
    stops = [params[i].stop_token_array for i in rows]
    eos_rows = [i for i in rows if not params[i].ignore_eos]
    ids = np.concatenate([*stops, *[eos_token_ids] * len(eos_rows)])
    row_of = np.repeat(
        np.array(rows + eos_rows, np.int64), [len(s) for s in stops] + [len(eos_token_ids)] * len(eos_rows)
    )
    return (row_of * vocab_size + ids)[ids < vocab_size]


def logit_bias_entries(params: list[SamplingParams], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64[E] flat indexes row * vocab_size + token, float32[E] biases) of every row's logit_bias."""
    flat = [i * vocab_size + t for i, p in enumerate(params) if p.logit_bias for t in p.logit_bias]
    values = [b for p in params if p.logit_bias for b in p.logit_bias.values()]
    return np.array(flat, np.int64), np.array(values, np.float32)


def is_penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0


def draw_uniforms(rng: np.random.Generator, generators: list[np.random.Generator | None]) -> np.ndarray:
    """float64[R]: one uniform per sampled (non-greedy) row: first the shared `rng`'s, one call for all the
    unseeded rows in row order, then each seeded row's own generator's, so a seeded request's draws do not
    depend on the rest of the batch."""
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return rng.random(len(generators))
    u = np.empty(len(generators))
    u[unseeded] = rng.random(len(unseeded))
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = g.random()
    return u


@dataclass
class SamplerOutput:
    token_ids: np.ndarray  # int64[N]
    # Per row when params.logprobs is not None: [(sampled id, logprob), then the top k (id, logprob) in
    # rank order]; None otherwise.
    logprobs: list[list[tuple[int, float]] | None]
    # Rank of the sampled token by raw logprob (1 = most likely) where logprobs were asked; None otherwise.
    ranks: list[int | None]


@dataclass
class PendingSample:
    """Sampling issued on the backend, not waited for: the engine's next forward reads `token_ids` where they
    were computed (so the host need not know them to launch it), and result() waits for them on the host."""

    token_ids: Any  # int32 or int64[N], on the backend's device
    result: Callable[[], SamplerOutput]  # waits for the ids (and logprobs) sampled, not for later work


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0, eos_token_ids: tuple[int, ...] = ()):
        self.vocab_size = vocab_size
        # int64[E]: masked while min_tokens is not reached
        self._eos_array = np.array(eos_token_ids, np.int64)
        self._eos_set = frozenset(eos_token_ids)
        self._rng = make_generator(seed)  # for the rows without a seed of their own
        # The last step's stop/EOS mask and what it was made for: (params, which rows were under min_tokens,
        # flat indexes). A steady batch keeps it from step to step; the params are held, so ids are not
        # reused.
        self._stop_mask: tuple[list[SamplingParams], list[bool], np.ndarray] = ([], [], np.empty(0, np.int64))
        # Tokens per block of the inverse CDF: the largest power of two dividing V and at most sqrt(V).
        self._cdf_block = 1
        while (2 * self._cdf_block) ** 2 <= vocab_size and vocab_size % (2 * self._cdf_block) == 0:
            self._cdf_block *= 2
        # _inverse_cdf in one native call where it can be built: the same tokens, bit for bit, in a few us
        self._draw = native_sampling.kernel(vocab_size, self._cdf_block) or self._inverse_cdf

    def sample(
        self,
        logits: np.ndarray,
        params: list[SamplingParams],
        generators: list[np.random.Generator | None],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
    ) -> SamplerOutput:
        """Row i of `logits` (float32[N, vocab]) belongs to the request with params[i], generators[i]
        (its make_generator(seed) generator, or None), prompt_ids[i] and output_ids[i] (tokens so far)."""
        n = len(params)
        if logits.ndim != 2 or logits.shape != (n, self.vocab_size):
            raise ValueError(f"logits must have shape ({n}, {self.vocab_size}), got {logits.shape}")
        if not len(generators) == len(prompt_ids) == len(output_ids) == n:
            raise ValueError("generators, prompt_ids and output_ids must have one entry per row of logits")
        # Fast path, the common case of a benchmark or a greedy batch: every row greedy, nothing to penalize,
        # bias or report, so the steps below reduce to argmax with the min_tokens mask; one pass decides it.
        if not any(
            p.temperature or p.logprobs is not None or is_penalized(p) or p.logit_bias for p in params
        ):
            return SamplerOutput(self._greedy(logits, params, output_ids), [None] * n, [None] * n)
        x = self._mask_stop_tokens(logits, params, output_ids)
        if any(p.logit_bias for p in params):
            flat, bias = logit_bias_entries(params, self.vocab_size)
            x = x.copy() if x is logits else x
            x.reshape(-1)[flat] += bias
        x = self._apply_penalties(x, params, prompt_ids, output_ids)

        # Rows are told apart in Python: at a few rows each NumPy call costs more than its arithmetic.
        rows = [i for i, p in enumerate(params) if p.temperature]
        if len(rows) == n:
            token_ids = self._sample_random(x, params, generators)
        else:
            token_ids = x.argmax(axis=1)
            if rows:
                token_ids[rows] = self._sample_random(
                    x[rows], [params[i] for i in rows], [generators[i] for i in rows]
                )
        return self._with_logprobs(logits, params, token_ids)

    def launch(
        self,
        logits: np.ndarray,
        params: list[SamplingParams],
        generators: list[np.random.Generator | None],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
    ) -> PendingSample:
        """sample(), for the engine's step pipeline: on the host it is done when issued."""
        out = self.sample(logits, params, generators, prompt_ids, output_ids)
        return PendingSample(out.token_ids, lambda: out)

    def _greedy(self, logits, params, output_ids) -> np.ndarray:
        """int64[N]: each row's argmax once its stop and EOS ids are masked until min_tokens. Masking only
        lowers those ids, so a row's plain argmax stands unless it is one of them: only such rows are masked
        and searched again. Masking every row under min_tokens cost 25-30 us a step beside 8 such requests (8%
        of a bundled-model step); most steps now copy nothing."""
        token_ids = logits.argmax(axis=1)
        waiting = [i for i, (p, out) in enumerate(zip(params, output_ids)) if len(out) < p.min_tokens]
        if waiting:
            ids, eos = token_ids.tolist(), self._eos_set
            redo = [
                i
                for i in waiting
                if ids[i] in params[i].stop_token_set or (ids[i] in eos and not params[i].ignore_eos)
            ]
            if redo:
                x = np.ascontiguousarray(logits[redo])  # float32[R, V]
                x.reshape(-1)[
                    stop_token_indexes(
                        [params[i] for i in redo],
                        [output_ids[i] for i in redo],
                        self._eos_array,
                        self.vocab_size,
                    )
                ] = -np.inf
                token_ids[redo] = x.argmax(axis=1)
        return token_ids

    def _mask_stop_tokens(self, logits, params, output_ids):
        """logits with each row's stop and EOS ids at -inf while it is under min_tokens (a copy), or logits.
        The flat indexes are the last step's where the same params are under min_tokens in the same rows (the
        same requests, still in their first min_tokens tokens: ~1.5 us to tell, ~7 us to rebuild at 8
        rows)."""
        waiting = [len(out) < p.min_tokens for p, out in zip(params, output_ids)]
        last_params, last_waiting, flat = self._stop_mask
        if waiting != last_waiting or not all(map(operator.is_, params, last_params)):
            flat = stop_token_indexes(params, output_ids, self._eos_array, self.vocab_size)
            self._stop_mask = list(params), waiting, flat  # (a copy: the caller may reuse its list)
        if not flat.size:
            return logits
        x = logits.copy()
        x.reshape(-1)[flat] = -np.inf
        return x

    def _apply_penalties(self, x, params, prompt_ids, output_ids):
        rows = [i for i, p in enumerate(params) if is_penalized(p)]
        if not rows:
            return x
        repetition = np.array([[params[i].repetition_penalty] for i in rows], np.float32)  # [R, 1]
        frequency = np.array([[params[i].frequency_penalty] for i in rows], np.float32)
        presence = np.array([[params[i].presence_penalty] for i in rows], np.float32)
        counts = self._token_counts([output_ids[i] for i in rows])  # int64[R, V]
        in_output = counts > 0
        seen = in_output | (self._token_counts([prompt_ids[i] for i in rows]) > 0)
        sub = x[rows]  # float32[R, V]
        sub = np.where(seen, np.where(sub > 0, sub / repetition, sub * repetition), sub)
        sub = sub - frequency * counts - presence * in_output
        x = x.copy()
        x[rows] = sub
        return x

    def _token_counts(self, id_lists: list[list[int]]) -> np.ndarray:
        lengths = [len(ids) for ids in id_lists]
        flat = np.fromiter(chain.from_iterable(id_lists), np.int64, sum(lengths))
        row_of = np.repeat(np.arange(len(id_lists)), lengths)
        counts = np.bincount(row_of * self.vocab_size + flat, minlength=len(id_lists) * self.vocab_size)
        return counts.reshape(len(id_lists), self.vocab_size)

    def _sample_random(self, x, params, generators) -> np.ndarray:
        x = x.astype(np.float32, copy=False)
        # Unnormalized probabilities scaled so the top one is 1: min-p compares against min_p directly.
        # Shifting before dividing keeps a tiny temperature from overflowing.
        probs = x - x.max(axis=1, keepdims=True)  # float32[R, V]
        if any(p.temperature != 1 for p in params):  # (dividing by 1 changes no number: spared)
            probs /= np.array([p.temperature for p in params], np.float32)[:, None]
        np.exp(probs, out=probs)
        if any(p.min_p for p in params):
            min_p = np.array([p.min_p for p in params], np.float32)
            probs[probs < min_p[:, None]] = 0
        if any(0 < p.top_k < self.vocab_size or p.top_p < 1 for p in params):
            top_k = np.array([p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size for p in params])
            top_p = np.array([p.top_p for p in params], np.float64)
            cut = np.flatnonzero((top_k < self.vocab_size) | (top_p < 1))
            probs[cut] = self._top_k_top_p(probs[cut], top_k[cut], top_p[cut])

        return self._draw(probs, draw_uniforms(self._rng, generators))

    def _inverse_cdf(self, probs, u) -> np.ndarray:
        """Per row, the first token whose running probability sum passes u times the row's mass: never a
        token of probability 0. Done in two levels, blocks of tokens then the tokens of one block, so the
        float64 running sums (the costly part) cover about 2 sqrt(V) values per row instead of V."""
        rows, size = len(probs), self._cdf_block
        blocks = probs.reshape(rows, -1, size)  # float32[R, V / B, B]
        block_cdf = np.cumsum(blocks.sum(axis=2, dtype=np.float64), axis=1)  # float64[R, V / B]
        target = u * block_cdf[:, -1]  # below the row's mass even after rounding, as u < 1
        block = (block_cdf <= target[:, None]).sum(axis=1)  # the first block passing it
        r = np.arange(rows)
        before = np.where(block > 0, block_cdf[r, block - 1], 0.0)
        inside = blocks[r, block]  # float32[R, B]
        cdf = before[:, None] + np.cumsum(inside, axis=1, dtype=np.float64)
        token = (cdf <= target[:, None]).sum(axis=1)
        # This running sum can round below the block's sum: then take the block's last kept token.
        last = size - 1 - (inside[:, ::-1] > 0).argmax(axis=1)
        return block * size + np.minimum(token, last)

    def _top_k_top_p(self, probs, top_k, top_p) -> np.ndarray:
        """probs with the tokens outside each row's top-k, then outside its top-p nucleus, set to 0."""
        # Sorting a whole large vocabulary is slow; the kept tokens are usually among the few most likely,
        # so decide among those first and sort the whole row only where they do not suffice.
        few = min(int(top_k.max()), self.vocab_size if (top_p == 1).all() else _NUCLEUS_CANDIDATES)
        kept, decided = self._cut_among_top(probs, top_k, top_p, few)
        undecided = np.flatnonzero(~decided)
        if undecided.size:
            kept[undecided], _ = self._cut_among_top(
                probs[undecided], top_k[undecided], top_p[undecided], self.vocab_size
            )
        return kept

    def _cut_among_top(self, probs, top_k, top_p, m):
        """The top-k/top-p cut decided among the m most likely tokens of each row, and whether it could be:
        the top k must lie within them, and (without top-k) the nucleus mass must be reached within them."""
        if m < self.vocab_size:
            ids = np.argpartition(-probs, m - 1, axis=1)[:, :m]  # int64[R, m], unordered
        else:
            ids = np.broadcast_to(np.arange(self.vocab_size), probs.shape)
        top = np.take_along_axis(probs, ids, axis=1)
        order = np.argsort(-top, axis=1)  # most likely first
        ids = np.take_along_axis(ids, order, axis=1)
        top = np.take_along_axis(top, order, axis=1).astype(np.float64)  # float64[R, m]
        top[np.arange(m) >= top_k[:, None]] = 0
        cdf = np.cumsum(top, axis=1)
        # Top-p renormalizes within the top k; without top-k that is the whole row's mass.
        no_top_k = top_k >= self.vocab_size
        total = np.where(no_top_k, probs.sum(axis=1, dtype=np.float64), cdf[:, -1])
        threshold = top_p * total
        # Keep a token while the mass of the more likely tokens before it is still short of top_p.
        top[cdf - top >= threshold[:, None]] = 0
        kept = np.zeros_like(probs)
        np.put_along_axis(kept, ids, top.astype(probs.dtype), axis=1)
        decided = (top_k <= m) | (no_top_k & (cdf[:, -1] >= threshold))
        return kept, decided

    def _with_logprobs(self, logits, params, token_ids) -> SamplerOutput:
        n = len(params)
        logprobs, ranks = [None] * n, [None] * n
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if rows:
            raw = logits[rows].astype(np.float32, copy=False)  # float32[R, V]
            top_raw = raw.max(axis=1)
            # log-softmax = raw - logsumexp(raw), the sum in float64
            lse = top_raw + np.log(np.exp(raw - top_raw[:, None]).sum(axis=1, dtype=np.float64))
            sampled = token_ids[rows]
            sampled_raw = raw[np.arange(len(rows)), sampled]
            row_ranks = 1 + (raw > sampled_raw[:, None]).sum(axis=1)
            k = min(max(params[i].logprobs for i in rows), self.vocab_size)
            top = np.argpartition(-raw, k - 1, axis=1)[:, :k] if k else np.empty((len(rows), 0), np.int64)
            # rank order; equal logits by lowest id
            top = np.sort(top, axis=1)
            top = np.take_along_axis(
                top, np.argsort(-np.take_along_axis(raw, top, axis=1), axis=1, kind="stable"), axis=1
            )
            for j, i in enumerate(rows):
                logprobs[i] = [
                    (int(t), float(raw[j, t]) - float(lse[j]))
                    for t in (sampled[j], *top[j, : params[i].logprobs])
                ]
                ranks[i] = int(row_ranks[j])
        return SamplerOutput(token_ids, logprobs, ranks)
