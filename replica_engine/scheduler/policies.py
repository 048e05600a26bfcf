"""Scheduling policies: the order a step's token budget is spent in.

`stall_free` is Sarathi-Serve's stall-free batching (the default); `prefill_first` and `static`
reproduce the Orca/vLLM-v0 and request-level baselines for benchmarks. All of them admit waiting
requests by priority (lower value first), FCFS among equals, and preempt the least urgent."""

from __future__ import annotations

from replica_engine.scheduler.core import Scheduler
from replica_engine.scheduler.plan import StepPlan


def _owes_one_token(num_owed: int) -> bool:
    return num_owed == 1


def _owes_many_tokens(num_owed: int) -> bool:
    return num_owed > 1


def _any(num_owed: int) -> bool:
    return True


class StallFreeScheduler(Scheduler):
    """Decodes first (never stalled by a prefill), then prompts part-way through, then new
    requests by priority and arrival; prompts are chunked to whatever budget is left."""

    def _fill(self, plan: StepPlan) -> None:
        self._schedule_running(plan, _owes_one_token, chunked=True)
        self._schedule_running(plan, _owes_many_tokens, chunked=True)
        self._admit_waiting(plan, chunked=True)


class PrefillFirstScheduler(Scheduler):
    """Orca/vLLM-v0: whole prompts are admitted eagerly; running decodes wait for a step without
    prefills (the generation stall that Sarathi removes)."""

    def _fill(self, plan: StepPlan) -> None:
        self._admit_waiting(plan, chunked=False)
        if plan.is_empty:
            self._schedule_running(plan, _any, chunked=False)


class StaticScheduler(Scheduler):
    """Request-level batching: a batch is admitted only when the previous one has drained."""

    def _fill(self, plan: StepPlan) -> None:
        if self.running:
            self._schedule_running(plan, _any, chunked=False)
        else:
            self._admit_waiting(plan, chunked=False)


SCHEDULING_POLICIES: dict[str, type[Scheduler]] = {
    "stall_free": StallFreeScheduler,
    "prefill_first": PrefillFirstScheduler,
    "static": StaticScheduler,
}
