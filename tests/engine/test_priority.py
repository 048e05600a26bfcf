"""Request priority (vLLM's): lower values are admitted first, FCFS among equals; the pool's
victim is the least urgent running request. At one priority the order is exactly plain FCFS."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.sampling_params import SamplingParams
from replica_engine import EngineConfig, InvalidRequestError
from replica_engine.engine import LLMEngine
from replica_engine.kv_cache_manager import blocks_for_tokens
from replica_engine.request import Request, RequestStatus
from replica_engine.scheduler import SCHEDULING_POLICIES, Scheduler
from replica_engine.scheduler.waiting_queue import WaitingQueue
from tests.engine.scheduler_harness import (
    Run,
    add_request,
    make_scheduler,
    run_to_completion,
    scheduled_tokens,
    step,
)
from tests.engine.test_scheduler import arrivals_strategy


@pytest.mark.parametrize("policy", sorted(SCHEDULING_POLICIES))
def test_waiting_requests_are_admitted_by_priority_then_arrival(policy):
    scheduler = make_scheduler(policy, budget=256, max_seqs=16, num_blocks=64, block_size=4)
    for name, priority in [("a", 2), ("b", 0), ("c", 1), ("d", -1), ("e", 0), ("f", 2), ("g", 1)]:
        add_request(scheduler, name, priority=priority)
    # Budget, width and pool hold them all: one step admits all seven, most urgent first.
    assert list(step(scheduler)) == ["d", "b", "e", "c", "g", "a", "f"]


def test_equal_priorities_are_served_first_come_first_served_one_at_a_time():
    scheduler = make_scheduler("stall_free", budget=256, max_seqs=1, num_blocks=64, block_size=4)
    first_steps: dict[str, int] = {}
    arrivals = {0: [("a", 3), ("b", 3)], 2: [("c", 3), ("d", 1)], 5: [("e", 1), ("f", 3)]}
    for step_index in range(60):
        for name, priority in arrivals.get(step_index, []):
            add_request(scheduler, name, max_tokens=3, priority=priority)
        for name in step(scheduler):
            first_steps.setdefault(name, step_index)
    assert not scheduler.has_unfinished_requests()
    # a runs alone from step 0; then the 1s (d, e) in arrival order, then the 3s (b, c, f).
    assert sorted(first_steps, key=first_steps.__getitem__) == ["a", "d", "e", "b", "c", "f"]


def test_a_dry_pool_preempts_the_least_urgent_running_request_not_the_newest():
    # 3 blocks of 4 tokens. a (priority 1) holds two blocks, b (priority 0, newer) one; b's next
    # decode needs a block: a is preempted, though b is the newest.
    scheduler = make_scheduler("stall_free", budget=64, max_seqs=8, num_blocks=3, block_size=4)
    a = add_request(scheduler, "a", priority=1)
    assert step(scheduler) == {"a": 4}
    b = add_request(scheduler, "b", priority=0)
    assert step(scheduler) == {"a": 1, "b": 4}  # a's decode takes its second block, b the last
    batch = scheduler.schedule()
    assert scheduled_tokens(batch) == {"b": 1} and batch.num_preempted == 1
    assert a.status is RequestStatus.WAITING and not a.block_ids and b.status is RequestStatus.RUNNING


def test_a_preempted_request_goes_back_ahead_of_less_urgent_and_later_equal_arrivals():
    # c (priority 1) arrives first but waits behind a and b (priority 0); width 2.
    scheduler = make_scheduler("stall_free", budget=64, max_seqs=2, num_blocks=3, block_size=4)
    c = add_request(scheduler, "c", priority=1)
    add_request(scheduler, "a", priority=0)
    b = add_request(scheduler, "b", priority=0)
    assert step(scheduler) == {"a": 4, "b": 4}
    e = add_request(scheduler, "e", priority=0)  # as urgent as b, later
    assert step(scheduler) == {"a": 1}  # a takes the last block; b, the least urgent running, yields
    assert b.status is RequestStatus.WAITING
    d = add_request(scheduler, "d", priority=-1)  # more urgent, later
    assert list(scheduler.waiting) == [d, b, e, c]
    scheduled_in_order: list[str] = []  # each request once, when it is next scheduled
    while scheduler.has_unfinished_requests():
        scheduled_in_order += [name for name in step(scheduler) if name not in scheduled_in_order]
    assert [name for name in scheduled_in_order if name != "a"] == ["d", "b", "e", "c"]


@dataclass
class _FcfsQueue(WaitingQueue):
    """The queue as it was before priorities: arrivals at the back, preempted requests at the front."""

    _seen: set[Request] = field(default_factory=set)

    def _insert(self, request: Request) -> None:
        if request in self._seen:
            self._requests.appendleft(request)
        else:
            self._seen.add(request)
            self._requests.append(request)


def _fcfs_scheduler(policy: str, *args: int) -> Scheduler:
    """The scheduler with plain FCFS semantics: that queue, and the newest running request preempted."""
    scheduler = make_scheduler(policy, *args)
    scheduler.waiting = _FcfsQueue()
    scheduler._preemption_victim = lambda: scheduler.running[-1]  # type: ignore[method-assign]
    return scheduler


@pytest.mark.parametrize("policy", sorted(SCHEDULING_POLICIES))
@settings(max_examples=60, deadline=None)
@given(
    arrivals=arrivals_strategy,
    budget=st.integers(1, 128),
    max_seqs=st.integers(1, 8),
    spare_blocks=st.integers(0, 8),  # few: pools run dry and preempt
    tokens=st.lists(st.integers(0, 9), min_size=1, max_size=30),
)
def test_at_priority_zero_every_step_is_exactly_plain_fcfs(
    policy, arrivals, budget, max_seqs, spare_blocks, tokens
):
    block_size = 4
    largest = max(blocks_for_tokens(a.prompt_len + a.max_tokens, block_size) for a in arrivals)
    shape = (budget, max_seqs, largest + spare_blocks, block_size)

    def run(scheduler: Scheduler) -> Run:
        draws = iter(tokens * 10_000)
        return run_to_completion(scheduler, arrivals, lambda _: next(draws), frozenset({0}))

    runs = [run(make_scheduler(policy, *shape)), run(_fcfs_scheduler(policy, *shape))]
    ours, fcfs = ([(list(scheduled_tokens(b).items()), b.num_preempted) for b in run.batches] for run in runs)
    assert ours == fcfs
    assert [r.output_token_ids for r in runs[0].requests] == [r.output_token_ids for r in runs[1].requests]


# -- through the engine: a tiny Llama with random weights, token-id prompts -------------------------


@pytest.fixture(scope="module")
def one_request_engine() -> LLMEngine:
    """A pool of one 16-token block: a request of 8 + 8 tokens runs alone; priorities in [-5, 5]."""
    config = EngineConfig(model="dummy:tiny-llama", dtype="float32", num_kv_blocks=1, max_priority=5)
    return LLMEngine(config)


def test_the_most_urgent_request_finishes_first_when_the_pool_holds_one(one_request_engine):
    engine = one_request_engine
    for name, priority in [("low", 1), ("later_low", 1), ("urgent", -1)]:
        engine.add_request(
            list(range(1, 9)), SamplingParams(max_tokens=8, ignore_eos=True, priority=priority), name
        )
    finished = []
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == ["urgent", "low", "later_low"]  # FCFS would run urgent last


@pytest.mark.parametrize("priority", [6, -6, 10**9])
def test_a_priority_beyond_max_priority_is_refused_naming_the_field(one_request_engine, priority):
    with pytest.raises(InvalidRequestError) as error:
        one_request_engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, priority=priority))
    assert error.value.param == "priority" and "[-5, 5]" in str(error.value)
    assert not one_request_engine.has_unfinished_requests()
    for bound in (5, -5):  # the bounds themselves are allowed
        one_request_engine.abort_request(
            one_request_engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, priority=bound))
        )


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_max_priority_must_be_a_non_negative_integer(bad):
    with pytest.raises(InvalidRequestError) as error:
        EngineConfig(max_priority=bad)
    assert error.value.param == "max_priority"
