"""A step's plan: which requests run how many tokens, in batch order."""

from __future__ import annotations

from dataclasses import dataclass, field

from replica_engine.request import Request


@dataclass
class StepPlan:
    token_budget: int
    num_scheduled_tokens: dict[Request, int] = field(default_factory=dict)  # insertion order = batch order
    preempted: list[Request] = field(default_factory=list)

    @property
    def budget_left(self) -> int:
        return self.token_budget - self.total_tokens

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def samples(self, request: Request) -> bool:
        """A request samples a token when this step computes its last owed token."""
        return self.num_scheduled_tokens[request] == request.num_owed_tokens

    @property
    def sampling_requests(self) -> list[Request]:
        return [r for r in self.num_scheduled_tokens if self.samples(r)]

    def is_decode(self, request: Request) -> bool:
        """One token for a request already past its prompt; anything else is a prefill (chunk)."""
        return self.num_scheduled_tokens[request] == 1 and request.num_computed_tokens >= request.num_prompt_tokens

    def summary(self, duration_s: float = 0.0) -> StepSummary:
        decodes = [r for r in self.num_scheduled_tokens if self.is_decode(r)]
        return StepSummary(
            num_requests=len(self.num_scheduled_tokens),
            num_decode_requests=len(decodes),
            num_prefill_requests=len(self.num_scheduled_tokens) - len(decodes),
            num_prefill_tokens=self.total_tokens - len(decodes),
            num_preempted=len(self.preempted),
            duration_s=duration_s,
        )


@dataclass(frozen=True)
class StepSummary:
    """What one step did; passed to step listeners (metrics, tests)."""

    num_requests: int
    num_decode_requests: int
    num_prefill_requests: int
    num_prefill_tokens: int
    num_preempted: int
    duration_s: float
