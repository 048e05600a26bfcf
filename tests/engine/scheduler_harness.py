"""Drives a scheduler without a model: every step 'samples' a token chosen by a callback. Also
reads what only tests check (the engine never needs it): a batch's tokens per request, the free
queue's order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.sampling_params import SamplingParams
from replica_engine.kv_cache_manager import KVCacheManager
from replica_engine.request import Request
from replica_engine.scheduler import SCHEDULING_POLICIES, Scheduler, SchedulerConfig
from replica_engine.scheduler.plan import ScheduledBatch


@dataclass
class StepArrival:
    """A request arriving at a scheduler step (the benchmarks' Arrival is in seconds)."""

    step: int
    prompt_len: int
    max_tokens: int


@dataclass
class Run:
    scheduler: Scheduler
    requests: list[Request]
    batches: list[ScheduledBatch] = field(default_factory=list)
    first_admission_order: list[str] = field(default_factory=list)


def arrival_order(arrivals: list[StepArrival], requests: list[Request]) -> list[str]:
    """Request ids by arrival step; requests arriving in the same step keep submission order."""
    ordered = sorted(zip(arrivals, requests, strict=True), key=lambda pair: pair[0].step)
    return [request.request_id for _, request in ordered]


def scheduled_tokens(batch: ScheduledBatch) -> dict[str, int]:
    """Tokens the batch runs per request, in batch order."""
    return {row.request_id: row.num_tokens for row in batch.rows}


def free_block_ids(kv: KVCacheManager) -> tuple[int, ...]:
    """The free blocks in eviction order: the first is the next to be reused."""
    return tuple(kv._free)


def make_scheduler(policy: str, budget: int, max_seqs: int, num_blocks: int, block_size: int) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    return SCHEDULING_POLICIES[policy](SchedulerConfig(budget, max_seqs), kv)


def run_to_completion(
    scheduler: Scheduler,
    arrivals: list[StepArrival],
    next_token: Callable[[str], int] = lambda request_id: 7,
    stop_token_ids: frozenset[int] = frozenset(),
    check_step: Callable[[Scheduler, ScheduledBatch], None] = lambda scheduler, batch: None,
    max_steps: int = 100_000,
) -> Run:
    """Add requests at their arrival steps (in list order) and step until every one has finished."""
    pending = sorted(enumerate(arrivals), key=lambda item: (item[1].step, item[0]))
    requests = [
        Request(f"r{i}", [1] * a.prompt_len, SamplingParams(max_tokens=a.max_tokens), stop_token_ids)
        for i, a in enumerate(arrivals)
    ]
    run = Run(scheduler, requests)
    seen: set[str] = set()
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][1].step <= step:
            scheduler.add_request(requests[pending.pop(0)[0]])
        batch = scheduler.schedule()
        if batch.is_empty and not pending:
            raise AssertionError(f"step {step}: nothing scheduled but requests are unfinished (deadlock)")
        check_step(scheduler, batch)
        for row in batch.rows:
            if row.request_id not in seen:
                seen.add(row.request_id)
                run.first_admission_order.append(row.request_id)
        scheduler.update(batch, [next_token(row.request_id) for row in batch.sampling_rows])
        # the queue's running sum (load reports read it) is what its requests owe now
        waiting = scheduler.waiting
        owed = sum(r.num_owed_tokens - r.num_expected_cached_tokens for r in waiting)
        assert waiting.num_pending_tokens == owed, (step, waiting.num_pending_tokens, owed)
        run.batches.append(batch)
        step += 1
        assert step < max_steps, "no progress"
    return run


def add_request(
    scheduler: Scheduler, name: str, prompt_len: int = 4, max_tokens: int = 8, priority: int = 0
) -> Request:
    request = Request(name, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, priority=priority))
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler) -> dict[str, int]:
    """One step, every request 'sampling' token 7; the tokens it scheduled per request, in batch order."""
    batch = scheduler.schedule()
    scheduler.update(batch, [7] * len(batch.sampling_rows))
    return scheduled_tokens(batch)
