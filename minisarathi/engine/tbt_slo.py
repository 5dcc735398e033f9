"""tbt_slo_ms mode: the time a step may be predicted to take, from the TBT target and a safety margin that
adapts to the cost model's errors, and the overload state (running decodes alone predicted over the target).

The margin tracks the 98th percentile of the prediction error (actual - predicted) over the steps that come
near the target (predicted at least half of it; small steps' errors say little about full ones), by
stochastic quantile tracking: each such step moves it up by MARGIN_STEP x (1 - q) when the error exceeded
it, down by MARGIN_STEP x q otherwise, which settles where a fraction q = 2% of the steps overshoot (the
P99 TBT counts every token gap, most of them from steps further from the target).
It stays within [0, MAX_MARGIN x target], so a step always has a positive time to spend on prefills when the
decodes leave it room.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

ERROR_QUANTILE = 0.02  # the share of near-target steps allowed to exceed their predicted time + margin
MARGIN_STEP = 0.02  # x target: the largest move of the margin per step
INITIAL_MARGIN = 0.1  # x target
MAX_MARGIN = 0.5  # x target
NEAR_TARGET = 0.5  # x target: steps predicted at least this long adapt the margin


class TbtSlo:
    def __init__(self, target_s: float):
        self.target = target_s
        self.margin = INITIAL_MARGIN * target_s
        self.overloaded = False
        self.infeasible = False  # once a single decode was predicted over the target: fixed budget then
        self.overloaded_steps = 0  # steps in which the running decodes alone were predicted over the target
        self.overshoots = 0  # steps that took longer than the target
        self.num_steps = 0

    @property
    def limit(self) -> float:
        """What a step's predicted time may reach."""
        return self.target - self.margin

    def observe(self, predicted: float | None, actual: float) -> None:
        self.num_steps += 1
        if actual > self.target:
            self.overshoots += 1
        if predicted is None or predicted < NEAR_TARGET * self.target:
            return
        step = MARGIN_STEP * self.target
        if actual > predicted + self.margin:
            self.margin = min(self.margin + step * (1 - ERROR_QUANTILE), MAX_MARGIN * self.target)
        else:
            self.margin = max(self.margin - step * ERROR_QUANTILE, 0.0)

    def set_overloaded(self, overloaded: bool, decode_time: float) -> None:
        """Called once per step by the scheduler; logs the transitions."""
        if overloaded:
            self.overloaded_steps += 1
        if overloaded != self.overloaded:
            if overloaded:
                log.warning(
                    "overloaded: the running decodes alone are predicted to take %.2f ms, over the TBT "
                    "target of %.2f ms; new prompts wait",
                    decode_time * 1e3,
                    self.target * 1e3,
                )
            else:
                log.info(
                    "no longer overloaded: decodes predicted at %.1f ms (TBT target %.1f ms)",
                    decode_time * 1e3,
                    self.target * 1e3,
                )
        self.overloaded = overloaded

    def is_infeasible(self, one_decode_time: float) -> bool:
        """Whether a step of a single decode (predicted one_decode_time) is over the target; logs the first
        time it is."""
        infeasible = one_decode_time > self.target
        if infeasible and not self.infeasible:
            log.warning(
                "TBT target of %.2f ms is below the predicted time of a single decode (%.2f ms): steps "
                "use the fixed chunk_size budget while it is",
                self.target * 1e3,
                one_decode_time * 1e3,
            )
        self.infeasible = self.infeasible or infeasible
        return infeasible

    def summary(self) -> dict:
        return {
            "target_ms": self.target * 1e3,
            "margin_ms": self.margin * 1e3,
            "overloaded": self.overloaded,
            "infeasible": self.infeasible,
            "overloaded_steps": self.overloaded_steps,
            "overshoots": self.overshoots,
            "steps": self.num_steps,
        }
