"""Speculative decoding inside the token budget: n-gram (prompt lookup) drafts, verified as a chunk.

Each step the policy schedules as it always does; then, only from the budget the step left (tokens, and with
tbt_slo_ms the predicted time), each plain decode may take up to k draft tokens: the continuation of the
latest earlier occurrence of its last n tokens (prompt + output so far, n from prompt_lookup_max down to
prompt_lookup_min). Its last token and the drafts run as one chunk of k + 1 tokens (causal attention over its
history, the chunked-prefill path), with logits at all k + 1 positions. Row j is sampled as the sequence
would be after drafts[:j] (the sampler's min_tokens mask and penalties see them), and the draft is accepted
while each row's sampled token equals it; the first row that differs gives its own token (greedy: the
model's next token). For a deterministic draft this *is* standard rejection sampling: draft x is accepted
with probability p(x), and on rejection the token is distributed as p with x removed, renormalized. The
rejected drafts' KV slots are rolled back (blocks past the accepted tokens freed). k per sequence follows its
recent acceptance and the drafts' predicted cost (Speculating._speculate). Constrained rows (structured
outputs) do not speculate.

Two mixins: Speculating over the scheduler's policy class (slo_scheduler.make_scheduler composes it), and
Speculation over LLMEngine (engine.py's SpeculativeEngine), which overrides _make_batch (the drafts in the
chunk, logits at every position), _update (acceptance, rollback) and stats().
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from minisarathi.engine.cost_model import step_shape
from minisarathi.validation import check_int

METHODS = ("ngram",)
HISTORY_DECAY = 0.8  # per verification: a sequence's acceptance rate follows its last ~5 verifications
MIN_CHANCE = 0.2  # before the cost model's first fit: drafts go while their chance of acceptance is this


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config for method "ngram" (its names and defaults)."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"


def speculative_config(value: Any) -> SpeculativeConfig | None:
    """A SpeculativeConfig from a dict of vLLM's keys (or one already made, or None); ValueError if bad."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
    method = value.get("method", "ngram")
    if method == "draft_model" or "model" in value:
        raise ValueError("speculative_config: method 'draft_model' is not supported yet (only 'ngram')")
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(str, unknown))}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    k = value["num_speculative_tokens"]
    check_int("speculative_config num_speculative_tokens", k, lo=1)
    # vLLM's defaults: either bound defaults to the other, both to 5
    high, low = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
    high, low = high or low or 5, low or high or 5
    check_int("speculative_config prompt_lookup_max", high, lo=1)
    check_int("speculative_config prompt_lookup_min", low, lo=1)
    if low > high:
        raise ValueError(f"speculative_config: prompt_lookup_min ({low}) exceeds prompt_lookup_max ({high})")
    return SpeculativeConfig(k, high, low)


def propose(tokens: list[int], k: int, high: int, low: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n of `tokens`, for the largest
    n in [low, high] that occurs; [] if none does."""
    if k <= 0 or len(tokens) <= low:
        return []
    data = np.array(tokens, np.int32).tobytes()  # bytes.rfind searches in C, 4 bytes per token
    end = len(data) - 4  # an occurrence must end before the last token, so that something follows it
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        pattern, stop = data[-4 * n :], end
        while (at := data.rfind(pattern, 0, stop)) >= 0:
            if at % 4 == 0:  # aligned to a token
                follow = at // 4 + n
                return tokens[follow : follow + k]
            stop = at + len(pattern) - 1
    return []


def accepted_length(sampled: list[int], draft: list[int]) -> int:
    """How many leading drafts stand: draft[j] while row j (which saw draft[:j]) sampled it. With a
    deterministic draft this is rejection sampling: x is kept with probability p(x), and a rejection's token
    (that row's own sample) is distributed as p without x, renormalized."""
    m = 0
    while m < len(draft) and sampled[m] == draft[m]:
        m += 1
    return m


@dataclass
class Acceptance:
    """Counters as vLLM's spec_decode metrics: verification steps, tokens proposed, tokens accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def summary(self) -> dict:
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
        return {**dataclasses.asdict(self), "mean_acceptance_length": mean}


class Speculating:
    """Over a policy class: after the policy's schedule, drafts for its plain decodes from the budget left."""

    def __init__(self, config, block_manager, *args, **kwargs):
        super().__init__(config, block_manager, *args, **kwargs)
        self.spec = config.speculative_config
        self.cost_model = None  # set by make_scheduler: the engine's, fitted online while speculating
        self.drafts: dict = {}  # sequence -> this step's draft tokens (non-empty lists only)
        self.history: dict = {}  # sequence -> (drafts accepted, drafts tried), decayed
        self.acceptance = Acceptance()

    def schedule(self):
        out = super().schedule()
        self.drafts = {}
        self._speculate(out)
        return out

    def chance(self, seq) -> float:
        """seq's recent rate of accepted drafts among those it tried (Laplace's rule: 1/2 before any)."""
        accepted, tried = self.history.get(seq, (0.0, 0.0))
        return (accepted + 1) / (tried + 2)

    def _speculate(self, out) -> None:
        """Grow the step's plain decodes by drafts, in queue order, within what the step leaves: tokens within
        chunk_size, and with tbt_slo_ms a predicted time within the step's limit. Once the cost model is
        fitted, a draft token goes in only while its chance of acceptance (the sequence's recent rate to the
        power of its place) times what an accepted token saves exceeds its predicted cost. A token saves its
        sequence's share of a later step: its own decode, plus the step's fixed overhead only where the whole
        step is saved, counted as overhead / decodes^2 (all of it for one stream; next to nothing in a big
        batch, whose steps run for the other sequences anyway). Before the fit, drafts go in while that chance
        is at least MIN_CHANCE. Never preempts nor evicts."""
        tokens = self.token_budget - out.num_tokens
        model = self.cost_model
        priced = model is not None and model.fitted
        seconds = None
        if priced:
            if out.time_limit is not None:
                seconds = out.time_limit - model.predict(step_shape(out.scheduled))
            decodes = sum(1 for seq, n in out.scheduled.items() if n == 1 and not seq.in_prefill)
            overhead, per_token, per_decode, prefill_key, decode_key = model.coefficients.tolist()
            shared = overhead / max(decodes, 1) ** 2
        blocks, spec, size = self.blocks, self.spec, self.blocks.block_size
        for seq, n in list(out.scheduled.items()):
            if tokens <= 0:
                break
            if n != 1 or seq.in_prefill or seq.matcher is not None:
                continue
            start = seq.num_computed_tokens
            # the drafts and the token after them stay within the sequence's final length
            k = min(spec.num_speculative_tokens, tokens, seq.max_kv_tokens - seq.num_tokens)
            rate, chance, worth, extra = self.chance(seq), 1.0, 0, 0.0
            if (
                priced
            ):  # what an accepted token saves: its decode in a later step, and a share of the overhead
                saved = per_decode + decode_key * (start + 1) + shared
            while worth < k:  # the drafts worth verifying, from their chances alone (the lookup is the cost)
                chance *= rate
                if not priced:
                    if chance < MIN_CHANCE:
                        break
                else:  # the chunk's next token, at position start + worth + 1, as a prefill token
                    cost = per_token + prefill_key * (start + worth + 2)
                    if chance * saved <= cost or (seconds is not None and extra + cost > seconds):
                        break
                    extra += cost
                worth += 1
            if not worth:
                continue
            room = blocks.max_growth(seq) - len(blocks.evictable) * size - 1  # past the decode's own token
            draft = propose(
                seq.prompt_token_ids + seq.output_token_ids,
                min(worth, room),
                spec.prompt_lookup_max,
                spec.prompt_lookup_min,
            )
            if not draft:
                continue
            blocks.grow(seq, start + 1 + len(draft))
            out.scheduled[seq] = 1 + len(draft)
            self.drafts[seq] = draft
            tokens -= len(draft)
            if seconds is not None:
                seconds -= model.prefill_time(start, len(draft) + 1) - model.prefill_time(start, 1)

    def accepted(self, seq, proposed: int, accepted: int) -> None:
        """seq's drafts of this step were verified: count them, and its recent acceptance (the drafts
        tried: the accepted ones and the first rejected one)."""
        self.acceptance.num_drafts += 1
        self.acceptance.num_draft_tokens += proposed
        self.acceptance.num_accepted_tokens += accepted
        kept, tried = self.history.get(seq, (0.0, 0.0))
        self.history[seq] = (
            HISTORY_DECAY * kept + accepted,
            HISTORY_DECAY * tried + accepted + (accepted < proposed),
        )

    def remove_finished(self, finished) -> None:
        super().remove_finished(finished)
        for seq in finished:
            self.history.pop(seq, None)

    def abort(self, seq) -> None:
        super().abort(seq)
        self.history.pop(seq, None)


def speculating(policy: type) -> type:
    """The policy class with speculation after its schedule."""
    return type(f"Speculating{policy.__name__}", (Speculating, policy), {})


@dataclass(slots=True)
class DraftRow:
    """What sampling reads of a sequence, for the row that follows draft[:j]: its output so far includes them
    (min_tokens and the penalties count them); its random stream is the sequence's."""

    params: Any
    generator: Any
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    choices: list | None
    matcher: Any = None  # constrained rows do not speculate


class Speculation:
    """Over LLMEngine: verification chunks in the batch, acceptance and rollback after sampling."""

    def _make_batch(self, scheduled, starts):
        """The drafts ride in their sequences' chunks (appended for the call, as the chunk's tokens); their
        rows of logits are wanted too, each sampled as the sequence after the drafts before it (DraftRow)."""
        drafts = self._drafts = self.scheduler.drafts
        if not drafts:
            return super()._make_batch(scheduled, starts)
        for seq, draft in drafts.items():
            seq.output_token_ids += draft
        try:
            batch, samplers, num_prefill = super()._make_batch(scheduled, starts)
        finally:
            for seq, draft in drafts.items():
                del seq.output_token_ids[-len(draft) :]
        rows, expanded = [], []
        for row, seq in zip(batch.logits_indices.tolist(), samplers):
            draft = drafts.get(seq)
            if draft is None:
                rows.append(row)
                expanded.append(seq)
                continue
            rows += range(row - len(draft), row + 1)
            expanded.append(seq)  # row 0 samples as the sequence is
            history = seq.output_token_ids
            expanded += [
                DraftRow(seq.params, seq.generator, seq.prompt_token_ids, history + draft[:j], seq.choices)
                for j in range(1, len(draft) + 1)
            ]
        batch.logits_indices = np.array(rows, np.int32)  # int32[N + drafts]
        verify = sum(len(draft) + 1 for draft in drafts.values())  # decode tokens, not prefill ones
        return batch, expanded, num_prefill - verify

    def _update(self, step, sampled, now):
        """Accept each sequence's drafts while its rows sampled them, roll the rest back, then append the
        accepted tokens and the first other one as plain decoding would, one by one."""
        drafts = self._drafts
        if not drafts:
            return super()._update(step, sampled, now)
        ids, samplers, rows, i = sampled.token_ids.tolist(), step.samplers, [], 0
        kept = []
        while i < len(samplers):
            seq = samplers[i]
            draft = drafts.get(seq)
            if draft is None:
                rows.append(i)
                kept.append(seq)
                i += 1
                continue
            m = accepted_length(ids[i : i + len(draft) + 1], draft)
            rows += range(i, i + m + 1)
            kept += [seq] * (m + 1)
            self.scheduler.accepted(seq, len(draft), m)
            # KV holds the last token and the m accepted drafts; the token sampled after them is uncomputed
            seq.num_computed_tokens -= len(draft) - m
            self.block_manager.shrink(seq, seq.num_computed_tokens)
            step.schedule.scheduled[seq] = (
                1  # offered to the prefix cache below, once its tokens are appended
            )
            i += len(draft) + 1
        step.samplers = kept
        sampled = dataclasses.replace(
            sampled,
            token_ids=sampled.token_ids[rows],
            logprobs=[sampled.logprobs[r] for r in rows],
            ranks=[sampled.ranks[r] for r in rows],
        )
        outputs = super()._update(step, sampled, now)
        for seq in drafts:
            self.block_manager.register_computed(seq, seq.num_computed_tokens)
        # a sequence with several tokens this step reports once, its latest snapshot
        return list({o.request_id: o for o in outputs}.values())

    def stats(self) -> dict:
        return {**super().stats(), "spec_decode": self.scheduler.acceptance.summary()}
