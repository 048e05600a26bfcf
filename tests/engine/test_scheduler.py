"""Scheduler behaviour without a model: hand-made cases, then hypothesis over random workloads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.finish_reason import FinishReason
from replica_engine.kv_cache_manager import NULL_BLOCK_ID, blocks_for_tokens
from replica_engine.persistent_batch import PersistentBatch
from replica_engine.request import Request, RequestStatus
from replica_engine.scheduler import Scheduler
from replica_engine.scheduler.plan import ScheduledBatch
from tests.engine.scheduler_harness import (
    StepArrival,
    add_request,
    arrival_order,
    free_block_ids,
    make_scheduler,
    run_to_completion,
    scheduled_tokens,
    step,
)


def test_stall_free_runs_decodes_first_then_chunks_prompts_to_the_budget_left():
    scheduler = make_scheduler("stall_free", budget=16, max_seqs=8, num_blocks=64, block_size=4)
    a = add_request(scheduler, "a", 10)
    assert step(scheduler) == {"a": 10}  # whole prompt fits: a samples
    b = add_request(scheduler, "b", 40)
    assert list(step(scheduler).items()) == [("a", 1), ("b", 15)]  # a's decode first, b chunked
    c = add_request(scheduler, "c", 5)
    assert list(step(scheduler).items()) == [("a", 1), ("b", 15)]  # c waits: no budget left
    assert list(step(scheduler).items()) == [("a", 1), ("b", 10), ("c", 5)]
    assert a.output_token_ids == [7] * 4 and b.output_token_ids == [7] and c.output_token_ids == [7]


def test_prefill_first_stalls_decodes_while_prompts_are_admitted():
    scheduler = make_scheduler("prefill_first", budget=64, max_seqs=8, num_blocks=64, block_size=4)
    add_request(scheduler, "a", 10)
    step(scheduler)
    add_request(scheduler, "b", 20)
    assert step(scheduler) == {"b": 20}  # a's decode waits
    assert step(scheduler) == {"a": 1, "b": 1}


def test_static_admits_a_new_batch_only_when_the_last_has_drained():
    scheduler = make_scheduler("static", budget=64, max_seqs=8, num_blocks=64, block_size=4)
    a = add_request(scheduler, "a", 4, max_tokens=3)
    step(scheduler)
    add_request(scheduler, "b", 4, max_tokens=1)
    assert step(scheduler) == {"a": 1}
    assert step(scheduler) == {"a": 1}
    assert a.is_finished
    assert step(scheduler) == {"b": 4}


def test_out_of_blocks_preempts_the_newest_keeps_its_tokens_and_admits_nothing():
    # 3 blocks of 4 tokens. a and b each hold one full block; the next decode needs a new block.
    scheduler = make_scheduler("stall_free", budget=64, max_seqs=8, num_blocks=3, block_size=4)
    add_request(scheduler, "a", 4)
    b = add_request(scheduler, "b", 4)
    step(scheduler)  # prompts: a and b fill one block each and sample their first token
    c = add_request(scheduler, "c", 2)
    batch = scheduler.schedule()  # each decode needs a 2nd block: a takes the last; b, newest, is preempted
    scheduler.update(batch, [7] * len(batch.sampling_rows))
    assert batch.num_preempted == 1
    assert scheduled_tokens(batch) == {"a": 1}  # c is not admitted in a step that preempted
    assert b.status is RequestStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]  # nothing lost: recomputed later from prompt + output
    assert list(scheduler.waiting) == [b, c]  # front of the queue
    assert scheduler.num_preemptions == 1


def test_abort_frees_blocks_at_once_wherever_the_request_is():
    scheduler = make_scheduler("stall_free", budget=8, max_seqs=8, num_blocks=16, block_size=4)
    a = add_request(scheduler, "a", 20)
    step(scheduler)
    assert a.block_ids
    scheduler.finish_request(a, FinishReason.ABORT)
    w = add_request(scheduler, "w", 4)
    scheduler.finish_request(w, FinishReason.ABORT)
    assert scheduler.kv_cache_manager.num_free_blocks == 16
    assert not scheduler.has_unfinished_requests()
    assert a.finish_reason is FinishReason.ABORT


# -- properties over random workloads ---------------------------------------------------------

arrivals_strategy = st.lists(
    st.builds(
        StepArrival,
        step=st.integers(0, 30),
        prompt_len=st.integers(1, 120),
        max_tokens=st.integers(1, 40),
    ),
    min_size=1,
    max_size=25,
)


def _check_stall_free_step(
    scheduler: Scheduler, batch: ScheduledBatch, budget: int, max_seqs: int, runner_rows: PersistentBatch
) -> None:
    assert sum(scheduled_tokens(batch).values()) <= budget
    assert len(batch.rows) <= max_seqs
    assert len(scheduler.running) <= max_seqs
    block_size = scheduler.kv_cache_manager.block_size
    for row in batch.rows:
        request = scheduler.requests[row.request_id]
        assert row.num_tokens >= 1
        # Blocks for exactly the tokens computed after this step, no more; the batch holds a copy.
        assert len(request.block_ids) == blocks_for_tokens(
            request.num_computed_tokens + row.num_tokens, block_size
        )
        assert row.start_position == request.num_computed_tokens
    scheduled = scheduled_tokens(batch)
    skipped_decodes = [
        r for r in scheduler.running if r.num_owed_tokens == 1 and r.request_id not in scheduled
    ]
    # Stall-free: a running request owing one token is never left out for a prefill.
    assert not (skipped_decodes and batch.summary().num_prefill_requests), (skipped_decodes, batch)
    _check_ownership(scheduler, finished=[])  # no block lost, shared or null
    # The runner's rows, fed only the batches' diffs, hold each running request's whole table.
    if batch.is_empty:  # never sent to a runner
        return
    runner_rows.apply(batch)
    for row, table in zip(batch.rows, runner_rows.block_tables(batch).tolist(), strict=True):
        request_blocks = scheduler.requests[row.request_id].block_ids
        assert table[: len(request_blocks)] == request_blocks
        assert set(table[len(request_blocks) :]) <= {NULL_BLOCK_ID}
    sent = {r.request_id for r in scheduler.running if r.num_blocks_in_runner}
    assert {request_id for request_id in sent if runner_rows.holds(request_id)} == sent
    assert runner_rows.num_held == len(sent)  # finished and preempted ones forgotten


@settings(max_examples=150, deadline=None)
@given(
    arrivals=arrivals_strategy,
    budget=st.integers(1, 200),
    max_seqs=st.integers(1, 12),
    block_size=st.sampled_from([1, 4, 16]),
    spare_blocks=st.integers(0, 40),
    tokens=st.lists(st.integers(0, 9), min_size=1, max_size=50),
)
def test_stall_free_properties(arrivals, budget, max_seqs, block_size, spare_blocks, tokens):
    # The pool always holds the largest request alone (the engine rejects others up front).
    largest = max(blocks_for_tokens(a.prompt_len + a.max_tokens, block_size) for a in arrivals)
    scheduler = make_scheduler("stall_free", budget, max_seqs, largest + spare_blocks, block_size)
    longest = max(a.prompt_len + a.max_tokens for a in arrivals)
    runner_rows = PersistentBatch(max_seqs, longest, block_size, vocab_size=10)
    draws = iter(tokens * 10_000)
    run = run_to_completion(
        scheduler,
        arrivals,
        next_token=lambda request_id: next(draws),
        stop_token_ids=frozenset({0}),
        check_step=lambda s, batch: _check_stall_free_step(s, batch, budget, max_seqs, runner_rows),
    )
    for request, arrival in zip(run.requests, arrivals, strict=True):
        outputs = request.output_token_ids
        assert request.is_finished
        # Exactly max_tokens, or fewer ending in the stop token (and no token after a stop).
        assert len(outputs) == arrival.max_tokens or (outputs[-1] == 0 and len(outputs) < arrival.max_tokens)
        assert 0 not in outputs[:-1]
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    assert run.first_admission_order == arrival_order(
        arrivals, run.requests
    )  # FCFS; ties keep submission order


@pytest.mark.parametrize("policy", ["prefill_first", "static"])
@settings(max_examples=60, deadline=None)
@given(arrivals=arrivals_strategy, max_seqs=st.integers(1, 12), spare_blocks=st.integers(0, 40))
def test_baseline_policies_finish_everything_in_fcfs_order(policy, arrivals, max_seqs, spare_blocks):
    largest = max(blocks_for_tokens(a.prompt_len + a.max_tokens, 4) for a in arrivals)
    scheduler = make_scheduler(policy, 128, max_seqs, largest + spare_blocks, 4)
    run = run_to_completion(scheduler, arrivals)
    assert all(len(r.output_token_ids) == a.max_tokens for r, a in zip(run.requests, arrivals, strict=True))
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    assert run.first_admission_order == arrival_order(arrivals, run.requests)
    if policy == "prefill_first":  # no step mixes a prefill with decodes
        assert all(
            not (b.summary().num_prefill_requests and b.summary().num_decode_requests) for b in run.batches
        )


# -- block ownership under any interleaving of add, abort and step ------------------------------

operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 60), st.integers(1, 20)),  # prompt, max_tokens
        st.tuples(st.just("abort"), st.integers(0, 10_000)),  # which request added so far
        st.tuples(st.just("step"), st.integers(0, 9)),  # the token every sampling row gets
    ),
    max_size=60,
)


def _check_ownership(scheduler: Scheduler, finished: list[Request]) -> None:
    kv = scheduler.kv_cache_manager
    owned = [block for request in scheduler.requests.values() for block in request.block_ids]
    free = free_block_ids(kv)
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert not set(owned) & set(free), "a block is both free and owned"
    assert NULL_BLOCK_ID not in owned and NULL_BLOCK_ID not in free
    assert len(owned) + len(free) == kv.num_blocks, "a block was lost"
    assert all(not request.block_ids for request in [*scheduler.waiting, *finished])


@settings(max_examples=200, deadline=None)
@given(
    ops=operations,
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    block_size=st.sampled_from([1, 4, 16]),
    spare_blocks=st.integers(0, 20),
)
def test_blocks_are_owned_once_under_any_add_abort_step_interleaving(
    ops, budget, max_seqs, block_size, spare_blocks
):
    # The engine's step thread applies adds and aborts between steps, in any order callers send them.
    largest = blocks_for_tokens(60 + 20, block_size)  # the engine refuses anything larger
    scheduler = make_scheduler("stall_free", budget, max_seqs, largest + spare_blocks, block_size)
    added: list[Request] = []
    for op in ops:
        if op[0] == "add":
            added.append(add_request(scheduler, f"r{len(added)}", op[1], max_tokens=op[2]))
        elif op[0] == "abort" and added:
            request = added[op[1] % len(added)]
            if not request.is_finished:
                scheduler.finish_request(request, FinishReason.ABORT)
        elif op[0] == "step":
            batch = scheduler.schedule()
            scheduler.update(batch, [op[1]] * len(batch.sampling_rows))
        _check_ownership(scheduler, [r for r in added if r.is_finished])
    while scheduler.has_unfinished_requests():  # drain
        step(scheduler)
        _check_ownership(scheduler, [r for r in added if r.is_finished])
    assert sorted(free_block_ids(scheduler.kv_cache_manager)) == list(
        range(1, scheduler.kv_cache_manager.num_blocks + 1)
    )
