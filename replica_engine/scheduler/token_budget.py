"""A step's prefill budget from a time-between-tokens target (`tbt_slo_s`).

Decodes are placed first and never limited by it: every running request gets its token. Each
prompt chunk after them gets the most tokens that keep the step's predicted time (the replica's
StepTimeModel) within `headroom * tbt_slo_s`, and never more than what is left of
`max_num_batched_tokens` (the cap). So that prompts always progress, a step carries at least
MIN_PREFILL_CHUNK prompt tokens even when its decodes alone are predicted over the target; such
steps are counted (`decodes_over_slo`) rather than starving prompts forever."""

from __future__ import annotations

from dataclasses import dataclass

from replica_engine.scheduler.step_time_model import StepShape, StepTime

MIN_PREFILL_CHUNK = 16  # prompt tokens a step always carries when a prompt is owed
HEADROOM = 0.9  # of the target: what the scheduler aims at, leaving room for host work after it


@dataclass(frozen=True)
class BudgetDecision:
    """What the SLO budget decided for one step, for the metrics."""

    token_budget: int  # tokens the step could carry: those placed before the first chunk + its allowance
    decodes_over_slo: bool  # the step was predicted over the target before any prompt token


class SLOTokenBudget:
    def __init__(self, model: StepTime, tbt_slo_s: float, headroom: float = HEADROOM) -> None:
        self.model = model
        self.tbt_slo_s = tbt_slo_s
        self.target_s = headroom * tbt_slo_s

    def allowance(self, shape: StepShape, start: int, limit: int) -> int:
        """The most prompt tokens (at most `limit`) that one request, `start` tokens into its
        sequence, may add to a step of `shape` within the target; at least what is missing of
        the minimum chunk."""
        floor = min(limit, max(0, MIN_PREFILL_CHUNK - shape.num_prefill_tokens))
        low, high = floor, limit  # invariant: `low` tokens are allowed
        while low < high:
            middle = (low + high + 1) // 2
            if self.model.predict(shape.plus(start, middle)) <= self.target_s:
                low = middle
            else:
                high = middle - 1
        return low

    def decide(self, shape: StepShape, start: int, limit: int) -> tuple[int, BudgetDecision]:
        """The allowance for the step's first prompt chunk, and the step's decision."""
        allowed = self.allowance(shape, start, limit)
        over = self.model.predict(shape) > self.target_s
        return allowed, BudgetDecision(shape.num_prefill_tokens + shape.num_decodes + allowed, over)
