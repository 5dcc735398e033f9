"""tbt_slo_ms mode: Sarathi's scheduling, with each step's prefills also held to a predicted time.

The cost model predicts the step's decodes; what the TBT target (less the adaptive margin of tbt_slo.py)
leaves goes to prefill chunks, split evenly like the tokens under max_partial_prefills. Overloaded (the
decodes alone predicted over the target), no new prompt is admitted. Liveness: the first prompt mid-prefill,
and the first new prompt of an otherwise empty step, get a block's worth of tokens whatever the predicted
time. A target not even one decode meets gets the fixed chunk_size budget (the overload metric still counts
it).

It attaches to SarathiScheduler through the scheduler's hooks: _prefill_budget, _grantable, _spend, _admit,
observe and summary.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisarathi.config import EngineConfig
from minisarathi.engine.block_manager import BlockManager
from minisarathi.engine.cost_model import CostModel, StepShape, step_shape
from minisarathi.engine.scheduler import POLICIES, PrefillBudget, SarathiScheduler, Scheduler, SchedulerOutput
from minisarathi.engine.speculative import speculating
from minisarathi.engine.tbt_slo import TbtSlo

ONE_DECODE = StepShape(decode_seqs=1, decode_attention=1)  # the cheapest step with a decode


@dataclass
class TimedBudget(PrefillBudget):
    out: SchedulerOutput | None = None  # the step being scheduled
    seconds: float | None = None  # predicted time in all; None: tokens only (no fit, or infeasible)
    time_share: float | None = None  # ... and per prompt
    floor: int | None = 0  # tokens the next grant gets whatever the time; None: admitting


class SloScheduler(SarathiScheduler):
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, max_model_len: int, cost_model: CostModel
    ):
        super().__init__(config, block_manager, max_model_len)
        self.cost_model = cost_model
        self.slo = TbtSlo(config.tbt_slo_ms / 1e3)
        self.min_chunk = block_manager.block_size  # the liveness grant

    def _prefill_budget(self, out: SchedulerOutput, tokens: int) -> TimedBudget:
        shares = super()._prefill_budget(out, tokens)
        budget = TimedBudget(tokens, shares.token_share, out, floor=self.min_chunk)
        if not self.cost_model.fitted:
            return budget
        decode_time = self.cost_model.predict(step_shape(out.scheduled))  # the decodes so far
        # with no decode the step is the overhead alone: a new prompt must still be able to start
        out.overloaded = bool(out.scheduled) and decode_time > self.slo.target
        self.slo.set_overloaded(out.overloaded, decode_time)
        # a target not even one decode meets: stopping admission would only serialize the requests
        if not (out.overloaded and self.slo.is_infeasible(self.cost_model.predict(ONE_DECODE))):
            out.time_limit = self.slo.limit
            budget.seconds = budget.time_share = out.time_limit - decode_time
            if self.max_partial_prefills is not None:
                budget.time_share = budget.seconds / self._num_prefill_shares()
        return budget

    def _grantable(self, budget: TimedBudget, start: int, remaining: int) -> int:
        n = super()._grantable(budget, start, remaining)
        if budget.floor is None:  # admitting: the first prompt of an otherwise empty step gets the floor
            floor = 0 if budget.out.scheduled else self.min_chunk
        else:  # the first prompt mid-prefill in queue order gets it, so each completes
            floor, budget.floor = budget.floor, 0
        if budget.seconds is not None:
            timed = self.cost_model.max_prefill_tokens(start, min(budget.seconds, budget.time_share))
            n = min(n, max(timed, floor))
        return n

    def _spend(self, budget: TimedBudget, start: int, n: int) -> None:
        super()._spend(budget, start, n)
        if budget.seconds is not None:
            budget.seconds -= self.cost_model.prefill_time(start, n)

    def _admit(self, out: SchedulerOutput, budget: TimedBudget, chunked: bool) -> None:
        if self.waiting and not out.preempted and out.overloaded and budget.seconds is not None:
            out.admission_stop = "overload"
            return
        budget.floor = None
        super()._admit(out, budget, chunked)

    def observe(self, predicted: float | None, actual: float) -> None:
        self.slo.observe(predicted, actual)

    def summary(self) -> dict:
        return self.slo.summary()


def make_scheduler(
    config: EngineConfig, block_manager: BlockManager, max_model_len: int, cost_model: CostModel | None = None
) -> Scheduler:
    """config.scheduler's policy; with tbt_slo_ms (sarathi only), Sarathi's under the time budget; with
    speculative_config, drafts after the policy's schedule (engine/speculative.py)."""
    cost_model = cost_model or CostModel()
    if config.tbt_slo_ms is not None:
        policy, args = SloScheduler, (cost_model,)
    else:
        policy, args = POLICIES[config.scheduler], ()
    if not config.speculative_config:
        return policy(config, block_manager, max_model_len, *args)
    scheduler = speculating(policy)(config, block_manager, max_model_len, *args)
    scheduler.cost_model = cost_model  # it prices the drafts
    return scheduler
