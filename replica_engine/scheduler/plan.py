"""A step's plan, in two forms. `StepPlan` is the scheduler's working copy while a policy fills
it (live requests as keys). `seal()` turns it into a `ScheduledBatch`: frozen copies of all the
model runner needs (token ids, positions, block ids, sampling rows), so nothing the runner reads
can change under it, whatever happens to the requests afterwards."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.sampling_params import SamplingParams
from replica_engine.request import Request
from replica_engine.scheduler.step_time_model import StepShape
from replica_engine.scheduler.token_budget import BudgetDecision

if TYPE_CHECKING:
    import torch  # a seeded request's generator; the scheduler itself needs no torch


@dataclass(frozen=True)
class StepSummary:
    """What one step did; passed to step listeners (metrics, the step-time model, tests)."""

    shape: StepShape  # of the requests that ran
    num_preempted: int
    duration_s: float
    budget_decision: BudgetDecision | None = None  # set when a TBT target sized the step
    # Requests finished with reason error: the batch raised and its rows were rerun one by one.
    num_failed_requests: int = 0

    @property
    def num_requests(self) -> int:
        return self.shape.num_requests

    @property
    def num_decode_requests(self) -> int:
        return self.shape.num_decodes

    @property
    def num_prefill_requests(self) -> int:
        return self.shape.num_requests - self.shape.num_decodes

    @property
    def num_prefill_tokens(self) -> int:
        return self.shape.num_prefill_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_requests


@dataclass(frozen=True)
class SamplingRow:
    """How to sample one request's next token. The generator is the request's own (seeded
    requests only); only the step thread draws from it. The rest is what sampling reads of the
    request beyond its params, copied as the step is sealed, and only for requests that use it."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_token_ids: Sequence[int] = ()  # repetition penalty (a prompt never changes)
    output_token_ids: tuple[int, ...] = ()  # penalties
    banned_token_ids: frozenset[int] = frozenset()  # stop tokens, until min_tokens are out
    allowed_tokens: torch.Tensor | None = None  # the grammar's bitmask for this token

    @property
    def is_plain(self) -> bool:
        """Nothing but temperature, top-k and top-p (the fast path)."""
        p = self.params
        return not (
            p.logit_bias
            or p.needs_token_history
            or p.logprobs is not None
            or self.banned_token_ids
            or self.allowed_tokens is not None
        )


@dataclass(frozen=True)
class PromptLogprobsSlice:
    """A prefill chunk's share of a request's prompt logprobs: the chunk's tokens from `offset`
    on predict `targets` (the prompt tokens after them), with `num_top` alternatives each."""

    offset: int
    targets: tuple[int, ...]
    num_top: int


@dataclass(frozen=True)
class ScheduledRow:
    """One request's share of a step: tokens at positions start_position.. of its sequence."""

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int  # tokens already in the cache before this step
    block_ids: tuple[int, ...]  # covers start_position + len(token_ids) tokens
    is_decode: bool  # one token, past the prompt
    sampling: SamplingRow | None  # set when this step computes the request's last owed token
    prompt_logprobs: PromptLogprobsSlice | None = None  # set for prompt chunks that want them

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class ScheduledBatch:
    """A sealed plan, in batch order: what the model runner executes."""

    rows: tuple[ScheduledRow, ...]
    num_preempted: int = 0
    budget_decision: BudgetDecision | None = None  # set when a TBT target sized the step

    def shape(self) -> StepShape:
        return StepShape.of((row.start_position, row.num_tokens, row.is_decode) for row in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows

    @property
    def sampling_rows(self) -> list[ScheduledRow]:
        return [row for row in self.rows if row.sampling is not None]

    def only(self, request_ids: Iterable[str]) -> ScheduledBatch:
        """The rows of these requests alone (the step's preemptions stay counted)."""
        keep = set(request_ids)
        rows = tuple(row for row in self.rows if row.request_id in keep)
        return ScheduledBatch(rows, self.num_preempted, self.budget_decision)

    def summary(self, duration_s: float = 0.0, num_failed_requests: int = 0) -> StepSummary:
        return StepSummary(
            self.shape(), self.num_preempted, duration_s, self.budget_decision, num_failed_requests
        )


@dataclass
class StepPlan:
    token_budget: int
    num_scheduled_tokens: dict[Request, int] = field(default_factory=dict)  # insertion order = batch order
    preempted: list[Request] = field(default_factory=list)
    budget_decision: BudgetDecision | None = None

    def shape(self) -> StepShape:
        return StepShape.of(
            (request.num_computed_tokens, num_tokens, _is_decode(request, num_tokens))
            for request, num_tokens in self.num_scheduled_tokens.items()
        )

    @property
    def budget_left(self) -> int:
        return self.token_budget - self.total_tokens

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def seal(self) -> ScheduledBatch:
        """Copy out, from the requests' state before the step runs: a request samples when this
        step computes its last owed token; a decode is one token for a request past its prompt."""
        return ScheduledBatch(
            tuple(_row(request, num_tokens) for request, num_tokens in self.num_scheduled_tokens.items()),
            len(self.preempted),
            self.budget_decision,
        )


def _row(request: Request, num_tokens: int) -> ScheduledRow:
    start = request.num_computed_tokens
    samples = num_tokens == request.num_owed_tokens
    return ScheduledRow(
        request_id=request.request_id,
        token_ids=tuple(request.token_ids(start, start + num_tokens)),
        start_position=start,
        block_ids=tuple(request.block_ids),
        is_decode=_is_decode(request, num_tokens),
        sampling=_sampling_row(request) if samples else None,
        prompt_logprobs=_prompt_logprobs_slice(request, start, start + num_tokens),
    )


def _sampling_row(request: Request) -> SamplingRow:
    params = request.sampling_params
    history = params.needs_token_history
    grammar = request.grammar
    # A grammar decides when output may end; min_tokens holds back stop tokens otherwise.
    holding = grammar is None and len(request.output_token_ids) < params.min_tokens
    return SamplingRow(
        params,
        request.generator,
        prompt_token_ids=request.prompt_token_ids if history and params.repetition_penalty != 1 else (),
        output_token_ids=tuple(request.output_token_ids) if history else (),
        banned_token_ids=request.stop_token_ids if holding else frozenset(),
        allowed_tokens=grammar.allowed_tokens() if grammar is not None else None,
    )


def _prompt_logprobs_slice(request: Request, start: int, end: int) -> PromptLogprobsSlice | None:
    """Positions p in [start, end) predict token p + 1; the prompt's, those not yet recorded
    (a preempted request recomputes its prompt but records each logprob once)."""
    num_top = request.sampling_params.prompt_logprobs
    if num_top is None:
        return None
    first = max(start, len(request.prompt_logprobs))
    last = min(end, request.num_prompt_tokens - 1)
    if first >= last:
        return None
    return PromptLogprobsSlice(first - start, tuple(request.prompt_token_ids[first + 1 : last + 1]), num_top)


def _is_decode(request: Request, num_tokens: int) -> bool:
    """One token, past the prompt (read before the step runs)."""
    return num_tokens == 1 and request.num_computed_tokens >= request.num_prompt_tokens
