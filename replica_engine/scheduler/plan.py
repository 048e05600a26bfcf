"""A step's plan: which requests run how many tokens, in batch order."""

from __future__ import annotations

from dataclasses import dataclass, field

from replica_engine.request import Request


@dataclass(frozen=True)
class StepSummary:
    """What one step did; passed to step listeners (metrics, tests)."""

    num_requests: int
    num_decode_requests: int
    num_prefill_requests: int
    num_prefill_tokens: int
    num_preempted: int
    duration_s: float

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_requests


@dataclass
class StepPlan:
    token_budget: int
    num_scheduled_tokens: dict[Request, int] = field(default_factory=dict)  # insertion order = batch order
    preempted: list[Request] = field(default_factory=list)
    # Set by seal(), from the requests' state before the step runs (update() changes that state).
    sampling_requests: list[Request] = field(default_factory=list)
    num_decode_requests: int = 0

    @property
    def budget_left(self) -> int:
        return self.token_budget - self.total_tokens

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def seal(self) -> None:
        """Fix the facts that depend on request state: a request samples a token when this step
        computes its last owed token; a decode is one token for a request past its prompt."""
        scheduled = self.num_scheduled_tokens.items()
        self.sampling_requests = [r for r, n in scheduled if n == r.num_owed_tokens]
        self.num_decode_requests = sum(
            1 for r, n in scheduled if n == 1 and r.num_computed_tokens >= r.num_prompt_tokens
        )

    def summary(self, duration_s: float = 0.0) -> StepSummary:
        num_requests = len(self.num_scheduled_tokens)
        return StepSummary(
            num_requests=num_requests,
            num_decode_requests=self.num_decode_requests,
            num_prefill_requests=num_requests - self.num_decode_requests,
            num_prefill_tokens=self.total_tokens - self.num_decode_requests,
            num_preempted=len(self.preempted),
            duration_s=duration_s,
        )
