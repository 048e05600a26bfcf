"""A step's plan, in two forms. `StepPlan` is the scheduler's working copy while a policy fills
it (live requests as keys). `seal()` turns it into a `ScheduledBatch`: frozen copies of what the
model runner needs and does not hold yet (token ids, positions, the blocks new since the runner
last saw each request, sampling rows), so nothing the runner reads can change under it, whatever
happens to the requests afterwards. The runner keeps the rest across steps
(replica_engine/persistent_batch.py). One thing is shared, not copied: a constrained request's
grammar, which the runner reads while the model runs and only the scheduler's update advances,
after the step.

A token not known when its row is sealed (async scheduling: the token a batch in flight samples)
is sent as PLACEHOLDER_TOKEN_ID; the runner puts in the token it sampled for that request last."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.lora import LoRARequest
from common.sampling_params import SamplingParams
from replica_engine.pooling import Pooling
from replica_engine.request import Request
from replica_engine.scheduler.step_time_model import StepShape
from replica_engine.scheduler.token_budget import BudgetDecision

if TYPE_CHECKING:
    import torch  # a seeded request's generator; the scheduler itself needs no torch

    from replica_engine.structured import RequestGrammar

PLACEHOLDER_TOKEN_ID = -1  # a row's last token, sampled by a batch still in flight


@dataclass(frozen=True)
class StepSummary:
    """What one step did; passed to step listeners (metrics, the step-time model, tests)."""

    shape: StepShape  # of the requests that ran
    num_preempted: int
    duration_s: float
    budget_decision: BudgetDecision | None = None  # set when a TBT target sized the step
    # Requests finished with reason error: the batch raised and its rows were rerun one by one.
    num_failed_requests: int = 0
    model_s: float = 0.0  # of duration_s, in the model's forward and sampling

    @property
    def overhead_s(self) -> float:
        """Everything else: scheduling, the batch's inputs, applying its outputs."""
        return max(0.0, self.duration_s - self.model_s)

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
    requests only); only the step thread draws from it. The scheduler sets the params, the banned
    tokens and the grammar; the model runner adds what it keeps or computes during the step: the
    grammar's bitmask, and for penalties the counts of the request's output tokens and the set of
    its prompt's."""

    params: SamplingParams
    generator: torch.Generator | None = None
    banned_token_ids: frozenset[int] = frozenset()  # stop tokens, until min_tokens are out
    grammar: RequestGrammar | None = None  # structured outputs: its matcher, read-only in the step
    allowed_tokens: torch.Tensor | None = None  # the grammar's bitmask for this token ([1, words])
    output_counts: torch.Tensor | None = None  # [vocab]: penalties
    prompt_seen: torch.Tensor | None = None  # [vocab] bool: the repetition penalty

    @property
    def is_plain(self) -> bool:
        """Nothing but temperature, top-k and top-p (the fast path)."""
        p = self.params
        return not (
            p.logit_bias
            or p.needs_token_history
            or p.logprobs is not None
            or self.banned_token_ids
            or self.grammar is not None
            or self.allowed_tokens is not None
        )


@dataclass(frozen=True)
class TokenHistory:
    """A penalty request's tokens so far, sent once: when the runner does not hold it yet."""

    prompt_token_ids: Sequence[int] = ()  # set for the repetition penalty (a prompt never changes)
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PromptLogprobsSlice:
    """A prefill chunk's share of a request's prompt logprobs: the chunk's tokens from `offset`
    on predict `targets` (the prompt tokens after them), with `num_top` alternatives each."""

    offset: int
    targets: tuple[int, ...]
    num_top: int


@dataclass(frozen=True)
class ScheduledRow:
    """One request's share of a step: tokens at positions start_position.. of its sequence. Its
    block table is what the runner holds of it up to `block_offset`, then `new_block_ids`:
    together they cover start_position + len(token_ids) tokens."""

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int  # tokens already in the cache before this step
    new_block_ids: tuple[int, ...]  # the request's blocks from block_offset on
    is_decode: bool  # one token, past the prompt
    sampling: SamplingRow | None  # set when this step computes the request's last owed token
    prompt_logprobs: PromptLogprobsSlice | None = None  # set for prompt chunks that want them
    block_offset: int = 0  # 0: the runner does not hold the request (new, or resumed)
    history: TokenHistory | None = None  # at offset 0, for a request with penalties
    pooling: Pooling | None = None  # an embedding request's prompt chunk: the runner pools it
    lora: LoRARequest | None = None  # the adapter its tokens run with (None: the base model)
    # A decode's draft tokens (speculative decoding), after its last token in token_ids: the step
    # samples at the last token and at each of them, and keeps drafts while they verify.
    draft_token_ids: tuple[int, ...] = ()
    # Leading tokens whose K/V its prefix-cache hit holds: recomputed for the prompt logprob of the
    # token after them, their K/V written to the null block, never over a shared block.
    num_cached_kv_tokens: int = 0
    # Of its tokens, how many (the leading ones) are its prompt's: the model treats prompt tokens
    # and generated ones each its own way (kernels/prompt_rows.py), whatever shares the step.
    num_prompt_tokens: int = 0

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
    released_request_ids: tuple[str, ...] = ()  # the runner may forget them: finished or preempted

    def shape(self) -> StepShape:
        return StepShape.of(
            step_rows(
                (row.start_position, row.num_tokens, row.is_decode, len(row.draft_token_ids))
                for row in self.rows
            )
        )

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
        return ScheduledBatch(rows, self.num_preempted, self.budget_decision, self.released_request_ids)

    def summary(
        self, duration_s: float = 0.0, num_failed_requests: int = 0, model_s: float = 0.0
    ) -> StepSummary:
        return StepSummary(
            self.shape(), self.num_preempted, duration_s, self.budget_decision, num_failed_requests, model_s
        )


@dataclass
class StepPlan:
    token_budget: int
    num_scheduled_tokens: dict[Request, int] = field(default_factory=dict)  # insertion order = batch order
    drafts: dict[Request, tuple[int, ...]] = field(default_factory=dict)  # decodes that speculate
    preempted: list[Request] = field(default_factory=list)
    budget_decision: BudgetDecision | None = None
    # Scheduled while a batch is in flight (async scheduling): its requests may be scheduled on.
    ahead: bool = False
    # Ahead, the pool ran short: the step waits for the batch in flight, then decides (and
    # preempts) as a synchronous step would.
    blocked: bool = False
    # The sum of num_scheduled_tokens, kept as rows come and go (schedule, unschedule): the
    # budget left is read for every row, and summing each time made a step quadratic in its rows.
    total_tokens: int = 0

    def shape(self) -> StepShape:
        return StepShape.of(
            step_rows(
                (request.num_planned_tokens, n, is_decode(request, n), len(self.drafts.get(request, ())))
                for request, n in self.num_scheduled_tokens.items()
            )
        )

    @property
    def budget_left(self) -> int:
        return self.token_budget - self.total_tokens

    def schedule(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` this step for the request (in place of any it had)."""
        self.total_tokens += num_tokens - self.num_scheduled_tokens.get(request, 0)
        self.num_scheduled_tokens[request] = num_tokens

    def unschedule(self, request: Request) -> None:
        self.total_tokens -= self.num_scheduled_tokens.pop(request, 0)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def seal(self, released_request_ids: tuple[str, ...] = ()) -> ScheduledBatch:
        """Copy out, from the requests' state before the step runs: a request samples when this
        step computes its last owed token; a decode is one token for a request past its prompt.
        Sealing is sending: each request's blocks so far count as held by the runner, and its
        tokens (and the one it samples) as in flight until the scheduler's update."""
        return ScheduledBatch(
            tuple(
                _row(request, num_tokens, self.drafts.get(request, ()))
                for request, num_tokens in self.num_scheduled_tokens.items()
            ),
            len(self.preempted),
            self.budget_decision,
            released_request_ids,
        )


def _row(request: Request, num_tokens: int, drafts: tuple[int, ...]) -> ScheduledRow:
    start = request.num_planned_tokens
    owed = num_tokens - len(drafts)
    samples = owed == request.num_owed_tokens and request.pooling is None  # embeddings: none
    offset = request.num_blocks_in_runner
    known = request.token_ids(start, start + owed)  # short of a placeholder, if one is owed
    row = ScheduledRow(
        request_id=request.request_id,
        token_ids=(*known, *[PLACEHOLDER_TOKEN_ID] * (owed - len(known)), *drafts),
        start_position=start,
        new_block_ids=tuple(request.block_ids[offset:]),
        is_decode=is_decode(request, num_tokens),
        sampling=_sampling_row(request) if samples else None,
        prompt_logprobs=_prompt_logprobs_slice(request, start, start + num_tokens),
        block_offset=offset,
        history=_token_history(request) if offset == 0 else None,
        pooling=request.pooling,
        lora=request.sampling_params.lora,
        draft_token_ids=drafts,
        num_cached_kv_tokens=max(0, min(num_tokens, request.prefix_hit_end - start)),
        num_prompt_tokens=max(0, min(num_tokens, request.num_prompt_tokens - start)),
    )
    request.num_blocks_in_runner = len(request.block_ids)
    request.num_in_flight_tokens += num_tokens
    request.num_output_placeholders += samples
    return row


def _sampling_row(request: Request) -> SamplingRow:
    params = request.sampling_params
    grammar = request.grammar
    # A grammar decides when output may end; min_tokens holds back stop tokens otherwise.
    holding = (
        grammar is None
        and len(request.output_token_ids) + request.num_output_placeholders < params.min_tokens
    )
    if holding:
        return SamplingRow(params, request.generator, banned_token_ids=request.stop_token_ids)
    if request.sampling_row is None:  # the same every step from here on: built once (frozen)
        request.sampling_row = SamplingRow(params, request.generator, grammar=grammar)
    return request.sampling_row


def _token_history(request: Request) -> TokenHistory | None:
    params = request.sampling_params
    if not params.needs_token_history:
        return None
    prompt = request.prompt_token_ids if params.repetition_penalty != 1 else ()
    return TokenHistory(prompt, tuple(request.output_token_ids))


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


def step_rows(rows: Iterable[tuple[int, int, bool, int]]) -> Iterator[tuple[int, int, bool]]:
    """(start, tokens, is decode) per row of the step-time model, from (start, tokens, is decode,
    draft tokens): a drafting row runs as one-token decodes (flat_batch.py), and is priced so."""
    for start, num_tokens, decode, num_drafts in rows:
        if num_drafts:
            yield from ((start + i, 1, True) for i in range(num_tokens))
        else:
            yield start, num_tokens, decode


def is_decode(request: Request, num_tokens: int) -> bool:
    """One token, past the prompt (read before the step runs)."""
    return num_tokens == 1 and request.num_planned_tokens >= request.num_prompt_tokens
