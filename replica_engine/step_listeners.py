"""What listens to the engine's steps: each is called on the step thread with the StepSummary of
every step in which some request ran. The engine registers its step work (StepLoad, which the
autoscaling report reads), the metrics (EngineMetrics.record_step) and, with a TBT target or
speculative decoding, the step-time model's learning; tests and benchmarks add their own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from replica_engine.scheduler.plan import StepSummary
from replica_engine.scheduler.step_time_model import StepTimeModel
from replica_engine.scheduler.token_budget import SLOTokenBudget

if TYPE_CHECKING:
    from replica_engine.metrics import EngineMetrics

StepListener = Callable[[StepSummary], None]


@dataclass
class StepLoad:
    """Seconds of step time beyond the fastest step seen so far: the load more requests would add
    to. Every step pays a fixed cost (on a GPU, reading the weights), which is not load: a replica
    whose steps are all small decodes is nearly idle, however continuously it steps."""

    fastest_step_s: float = float("inf")
    work_s: float = 0.0

    def __call__(self, step: StepSummary) -> None:
        self.fastest_step_s = min(self.fastest_step_s, step.duration_s)
        self.work_s += step.duration_s - self.fastest_step_s


@dataclass(frozen=True)
class StepTimeLearner:
    """Refreshes the step-time model with each measured step, and reports the model's error and
    the budget a TBT target set."""

    model: StepTimeModel
    slo_budget: SLOTokenBudget | None
    metrics: EngineMetrics | None

    def __call__(self, step: StepSummary) -> None:
        if step.num_failed_requests:  # its time includes the rows rerun one by one: not its shape's
            return
        model = self.model
        predicted_s = model.predict_raw(step.shape)  # the fit's error, before calibration
        model.observe(step.shape, step.duration_s)
        if self.metrics is not None and self.slo_budget is not None:
            self.metrics.record_budget(
                step.budget_decision, predicted_s, step.duration_s, self.slo_budget.tbt_slo_s
            )
