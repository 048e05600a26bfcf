"""What every scheduling policy shares: the queues, allocation with preemption, and the update
after a step. Policies only decide the order in which a step's token budget is spent.

Not thread-safe, by design: one thread (the engine's step thread) owns it and every request in it."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.finish_reason import FinishReason
from replica_engine.kv_cache_manager import KVCacheManager
from replica_engine.outputs import EngineStats
from replica_engine.request import Request, RequestStatus
from replica_engine.scheduler.draft_pricing import DraftPricing
from replica_engine.scheduler.plan import ScheduledBatch, StepPlan, is_decode
from replica_engine.scheduler.step_time_model import StepShape, StepTime, StepTimeModel
from replica_engine.scheduler.token_budget import SLOTokenBudget
from replica_engine.scheduler.waiting_queue import WaitingQueue, admission_key
from replica_engine.spec_decode.config import SpeculativeConfig
from replica_engine.spec_decode.drafts import may_draft, record_verification
from replica_engine.spec_decode.proposers import Proposer, make_proposer


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int  # token budget per step
    max_num_seqs: int  # most requests holding KV at once
    max_loras: int = 1  # LoRA adapters among running requests at once
    max_cpu_loras: int = 1  # adapters the runner keeps loaded (reported to routers: most recent)
    speculative: SpeculativeConfig | None = None  # proposes draft tokens for decodes


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        slo_budget: SLOTokenBudget | None = None,
        step_time: StepTime | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.slo_budget = slo_budget  # sizes prompt chunks from a TBT target; None: the budget alone
        self.step_time = step_time  # prices draft tokens (and is the TBT budget's model)
        # drafts for decodes: `proposer` (a draft model's, which the engine loads), else the method's
        spec = config.speculative
        self.proposer = proposer or (make_proposer(spec) if spec is not None else None)
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_added = 0  # the next request's arrival_seq
        self.num_draft_tokens = 0  # speculative decoding: draft tokens verified so far
        self.num_accepted_tokens = 0  # of them, kept
        self._released: list[str] = []  # held by the runner, since finished or preempted
        self.loaded_adapters: OrderedDict[str, None] = OrderedDict()  # names, least recent first

    # -- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        request.arrival_seq = self.num_added
        self.num_added += 1
        self._expect_cache_hit(request)
        self.waiting.push(request)

    def _expect_cache_hit(self, request: Request) -> None:
        """What the prefix cache holds of it as it queues, or will once running requests have
        computed it: load reports count only the rest."""
        kv = self.kv_cache_manager
        request.num_expected_cached_tokens = kv.num_hit_tokens(request, kv.num_expected_hit_blocks(request))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(
        self, step_work_s: float = 0.0, cached_block_hashes: tuple[bytes, ...] | None = None
    ) -> EngineStats:
        """The queues and the KV pool, as a snapshot, with the step work the engine measured;
        the prefix cache's keys as given (an earlier snapshot of them), else taken now."""
        kv = self.kv_cache_manager
        return EngineStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_pending_prompt_tokens=self.waiting.num_pending_tokens
            + sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running),
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            kv_cache_usage=kv.usage,
            num_cached_free_blocks=kv.num_free_cached_blocks,
            num_preemptions=self.num_preemptions,
            num_requests_added=self.num_added,
            num_requests_finished=self.num_finished,
            step_work_s=step_work_s,
            cached_block_hashes=kv.cached_hashes() if cached_block_hashes is None else cached_block_hashes,
            lora_adapters=tuple(self.loaded_adapters),
            num_running_context_tokens=sum(r.num_tokens for r in self.running),
            step_time_coefficients=self._step_time_coefficients(),
        )

    def _step_time_coefficients(self) -> tuple[float, ...]:
        """The learned step-time model's, for routers (none without a TBT target)."""
        model = self.slo_budget.model if self.slo_budget is not None else None
        return model.shape_coefficients if isinstance(model, StepTimeModel) else ()

    def finish_request(self, request: Request, reason: FinishReason) -> None:
        """End a request wherever it is (finish, stop string, abort); its blocks go back at once."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._free(request)
        del self.requests[request.request_id]  # its batches in flight: their rows are dropped
        if self.proposer is not None:
            self.proposer.request_finished(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.num_finished += 1

    @property
    def in_flight(self) -> set[str]:
        """The requests in a batch whose outputs are not back yet."""
        return {r.request_id for r in self.running if r.num_in_flight_tokens}

    # -- one step -----------------------------------------------------------------------
    def schedule(self, ahead: bool = False) -> ScheduledBatch:
        """The next step. `ahead` (async scheduling, a batch in flight): requests in flight are
        scheduled on, their sampled tokens as placeholders; except while a constrained request
        runs (its grammar needs each token before the next mask), and except when the pool runs
        short (an empty batch: wait for the batch in flight, then preempt as a synchronous step)."""
        plan = StepPlan(self.config.max_num_batched_tokens, ahead=ahead)
        if ahead and any(r.grammar is not None for r in self.running):
            return plan.seal()
        self._fill(plan)
        self._schedule_drafts(plan)
        if plan.is_empty or plan.blocked:  # not run: its blocks stay allocated for the next plan
            return StepPlan(plan.token_budget).seal()  # the runner hears of the released ones later
        released, self._released = tuple(self._released), []
        return plan.seal(released)

    def _free(self, request: Request) -> None:
        """Its blocks back to the pool; the runner told to forget it, if it holds it."""
        self.kv_cache_manager.free(request)
        if request.num_blocks_in_runner:
            request.num_blocks_in_runner = 0
            self._released.append(request.request_id)

    def _fill(self, plan: StepPlan) -> None:
        """Spend the step's budget: the one thing a policy decides."""
        raise NotImplementedError

    def update(
        self, batch: ScheduledBatch, sampled_token_ids: list[int], num_accepted: Sequence[int] = ()
    ) -> list[tuple[Request, int]]:
        """Advance the requests a step computed; `sampled_token_ids` (and `num_accepted`, draft
        tokens kept, where any row had drafts) follow `batch.sampling_rows`. Returns the requests
        that got tokens, with how many (some may now be finished). A rejected draft token's K/V
        was computed but does not count: the next step writes over it."""
        for row in batch.rows:
            request = self.requests[row.request_id]
            request.num_in_flight_tokens -= row.num_tokens
            request.num_computed_tokens += row.num_tokens - len(row.draft_token_ids)
        advanced, finished = [], []
        for index, (row, token_id) in enumerate(zip(batch.sampling_rows, sampled_token_ids, strict=True)):
            request = self.requests[row.request_id]
            request.num_output_placeholders -= 1
            kept = row.draft_token_ids[: num_accepted[index] if num_accepted else 0]
            self.num_draft_tokens += len(row.draft_token_ids)
            self.num_accepted_tokens += len(kept)
            record_verification(request, len(row.draft_token_ids), len(kept))
            reason, num_new = None, 0
            for token in (*kept, token_id):
                num_new += 1
                reason = request.append_output_token(token)
                if num_new <= len(kept):  # a draft token kept: its K/V is the sequence's
                    request.num_computed_tokens += 1
                if reason is not None:
                    finished.append((request, reason))
                    break
            advanced.append((request, num_new))
        for row in batch.rows:  # hashed once each draft token kept is in the sequence
            self.kv_cache_manager.cache_computed_blocks(self.requests[row.request_id])
        for request, reason in finished:
            self.finish_request(request, reason)
        return advanced

    # -- building blocks for policies ---------------------------------------------------
    def _schedule_running(self, plan: StepPlan, select: Callable[[int], bool], chunked: bool) -> None:
        """Schedule running requests that `select` picks by the tokens they owe, oldest first.
        When the pool is dry, preempt the least urgent running request until this one fits (or is
        itself the victim). A request in flight sits out (a pipeline's batches) unless the plan
        is ahead."""
        if plan.blocked:
            return
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request in plan.num_scheduled_tokens:
                continue
            if request.num_in_flight_tokens and not plan.ahead:
                continue
            owed = request.num_owed_tokens
            if not owed or not select(owed):
                continue
            num_tokens = self._chunk(plan, request, owed) if chunked else owed
            if num_tokens <= 0 or num_tokens > plan.budget_left:
                break
            while not self.kv_cache_manager.allocate(request, num_tokens):
                if plan.ahead:
                    plan.blocked = True
                    return
                victim = self._preemption_victim()
                self._preempt(victim, plan)
                if victim is request:
                    break
            else:
                plan.schedule(request, num_tokens)

    def _schedule_drafts(self, plan: StepPlan) -> None:
        """Draft tokens behind the plan's decodes, from what its budget leaves, as far as they
        pay (scheduler/draft_pricing.py) and the pool has room without preempting."""
        spec = self.config.speculative
        if self.proposer is None or spec is None or plan.blocked or plan.budget_left <= 0:
            return
        decodes = [r for r, n in plan.num_scheduled_tokens.items() if is_decode(r, n)]
        pricing = DraftPricing.of(
            StepShape.of((r.num_planned_tokens, 1, True) for r in decodes),
            plan.shape(),
            self.step_time,
            self.slo_budget.target_s if self.slo_budget is not None else None,
        )
        limits = {}
        for request in decodes:
            room = request.sampling_params.max_tokens - len(request.output_token_ids) - 1
            limit = min(spec.num_speculative_tokens, room, plan.budget_left)
            if limit > 0 and may_draft(request) and pricing.may_pay(request):
                limits[request] = limit
        proposals = {r: d for r, d in self.proposer.propose(limits).items() if d} if limits else {}
        for request, num_drafts in pricing.take(proposals, plan.budget_left).items():
            if self.kv_cache_manager.allocate(request, 1 + num_drafts):
                plan.schedule(request, 1 + num_drafts)
                plan.drafts[request] = tuple(proposals[request][:num_drafts])

    def _admit_waiting(self, plan: StepPlan, chunked: bool) -> None:
        """Admit waiting requests by (priority, arrival) while budget, width and blocks last. A request
        starts from its prompt's longest cached prefix: only the rest is charged to the budget
        and the pool. Nothing new is admitted in a step that had to preempt (or, ahead, would
        have): the pool is short. A request whose prompt's next block a running request is
        computing is passed over (parked) until it is computed, to read it from the cache rather
        than compute it twice; the queue behind it goes on (vLLM passes over requests waiting
        for remote K/V so)."""
        if plan.preempted or plan.blocked:
            return
        kv = self.kv_cache_manager
        parked = 0  # of the waiting queue's first requests, how many wait for a prefix
        while (
            len(self.waiting) > parked
            and len(self.running) < self.config.max_num_seqs
            and plan.budget_left > 0
        ):
            request = self.waiting.at(parked)
            cached_block_ids = kv.find_cached_blocks(request)
            if kv.waits_for_prefix(request, cached_block_ids):
                parked += 1
                continue
            owed = request.num_owed_tokens - kv.num_hit_tokens(request, len(cached_block_ids))
            if chunked:
                num_tokens = self._chunk(plan, request, owed)
                if num_tokens <= 0:
                    return
            elif owed <= plan.budget_left or plan.is_empty:
                # Whole prompts only; one longer than the budget runs as the step's sole work.
                num_tokens = owed
            else:
                return
            if not self._adapter_fits(request) or not kv.allocate(request, num_tokens, cached_block_ids):
                if not self.running and self._release_holds():
                    continue  # adopted blocks held for waiting requests filled the idle pool
                return
            self.waiting.remove(request)
            kv.release_hold(request)  # it holds what it found of them itself
            kv.claim_prefix(request)
            self._touch_adapter(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = request.num_computed_tokens
            self.running.append(request)
            plan.schedule(request, num_tokens)

    def _release_holds(self) -> bool:
        """Let go of the blocks held for waiting requests (prefill/decode disaggregation's adopted
        ones: they stay cached, to be found again unless evicted); whether there were any. With
        nothing running, holds alone can keep the first waiting request out, and the pool idle."""
        held = [request for request in self.waiting if request.held_block_ids]
        for request in held:
            self.kv_cache_manager.release_hold(request)
        return bool(held)

    def _adapter_fits(self, request: Request) -> bool:
        """Its LoRA adapter runs already, or fewer than max_loras do (the runner's slots)."""
        lora = request.sampling_params.lora
        if lora is None:
            return True
        running = {r.sampling_params.lora for r in self.running} - {None}
        return lora in running or len(running) < self.config.max_loras

    def _touch_adapter(self, request: Request) -> None:
        lora = request.sampling_params.lora
        if lora is None:
            return
        self.loaded_adapters.pop(lora.name, None)
        self.loaded_adapters[lora.name] = None
        while len(self.loaded_adapters) > self.config.max_cpu_loras:
            self.loaded_adapters.popitem(last=False)

    def _chunk(self, plan: StepPlan, request: Request, owed: int) -> int:
        """Tokens for a request that owes `owed` (net of cached blocks it is about to take):
        what is left of the budget, and for prompt chunks under a TBT target what the
        step-time model allows."""
        limit = min(owed, plan.budget_left)
        if self.slo_budget is None or owed == 1 or limit <= 0:
            return limit
        shape, start = plan.shape(), request.num_tokens - owed
        if plan.budget_decision is None:  # the step's first prompt chunk
            allowed, plan.budget_decision = self.slo_budget.decide(shape, start, plan.budget_left)
        else:
            allowed = self.slo_budget.allowance(shape, start, plan.budget_left)
        return min(owed, allowed)

    def _preemption_victim(self) -> Request:
        """vLLM's priority victim: the highest value, then the latest arrival. At one priority
        `running` is in arrival order, so this is the newest, as plain FCFS preempts. Never one in
        flight: its batch's update is still to come."""
        return max((r for r in self.running if not r.num_in_flight_tokens), key=admission_key)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Free the request's blocks and queue it again to recompute later, ahead of every later
        arrival of its priority. Its tokens (prompt and output so far) are kept: nothing is lost."""
        plan.unschedule(request)
        plan.preempted.append(request)
        if self.proposer is not None:
            self.proposer.request_preempted(request)
        self.running.remove(request)
        self._free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self._expect_cache_hit(request)
        self.waiting.push(request)
