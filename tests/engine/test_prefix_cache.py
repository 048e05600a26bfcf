"""The prefix cache's bookkeeping, without a model: hashing, hits, ref counts, LRU eviction, and
the scheduler admitting requests from their cached prefixes (random operation sequences)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from common.block_hash import chain_block_hashes, root_hash
from common.finish_reason import FinishReason
from common.logprobs import TokenLogprob
from common.sampling_params import SamplingParams
from replica_engine.kv_cache_manager import KVCacheManager
from replica_engine.request import Request, RequestStatus
from replica_engine.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from tests.engine.scheduler_harness import free_block_ids

BLOCK = 4


def _request(request_id: str, prompt: list[int], salt: str | None = None, max_tokens: int = 4) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, cache_salt=salt))


def _compute_prompt(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit the request as the scheduler does and mark its whole prompt computed; its hits."""
    hits = kv.find_cached_blocks(request)
    assert kv.allocate(request, request.num_tokens - len(hits) * BLOCK, hits)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return hits


def test_block_hashes_chain_over_every_earlier_token_and_the_salt():
    root = root_hash("m", None)
    first, second = chain_block_hashes(root, [1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)  # the partial block: none
    assert second != chain_block_hashes(root, [9, 2, 3, 4, 5, 6, 7, 8], BLOCK)[1]
    assert chain_block_hashes(first, [5, 6, 7, 8], BLOCK) == [second]  # a chain extends block by block
    assert root_hash("m", "tenant-a") != root_hash("m", "tenant-b") != root
    assert root_hash("other-model", None) != root
    # The documented format, packed here independently: sha256(parent || uint32 little-endian ids),
    # so a router in another process (or language) computes the same keys.
    expected = hashlib.sha256(root + struct.pack("<4I", 1, 2, 3, 4)).digest()
    assert first == expected
    large = [2**32 - 1, 0, 70000, 151646]  # every id a uint32 holds, beyond 16 bits too
    packed = hashlib.sha256(root + struct.pack("<4I", *large)).digest()
    assert chain_block_hashes(root, large, BLOCK) == [packed]


def test_a_second_request_reuses_the_full_blocks_and_recomputes_at_least_its_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    first = _request("a", list(range(1, 11)))  # 10 tokens: blocks 0, 1 full, block 2 partial
    _compute_prompt(kv, first)
    kv.free(first)
    same = _request("b", list(range(1, 11)))
    hits = kv.find_cached_blocks(same)
    assert len(hits) == 2  # the partial block is never cached
    exact = _request("c", list(range(1, 9)))  # 8 tokens = 2 full blocks: the last is recomputed
    assert len(kv.find_cached_blocks(exact)) == 1
    diverging = _request("d", [1, 2, 3, 4, 5, 6, 0, 8, 9])
    assert len(kv.find_cached_blocks(diverging)) == 1


def test_admission_charges_only_uncached_tokens_and_shares_blocks_by_reference():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK, enable_prefix_caching=True)
    a = _request("a", list(range(1, 18)))  # 17 tokens: 5 blocks
    _compute_prompt(kv, a)
    b = _request("b", [*range(1, 17), 99])  # same first 16 tokens
    hits = kv.find_cached_blocks(b)
    assert hits == a.block_ids[:4]
    assert kv.allocate(b, 1, hits)  # one new block for token 17: the pool has exactly one left
    assert b.num_computed_tokens == 16 and kv.num_free_blocks == 0
    assert all(kv.blocks[block_id].ref_count == 2 for block_id in hits)
    kv.free(a)
    assert all(kv.blocks[block_id].ref_count == 1 for block_id in hits)
    assert kv.num_free_blocks == 1  # a's own last block only


def test_freed_blocks_are_evicted_lru_with_a_requests_tail_first_and_lose_their_hash():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    a = _request("a", list(range(1, 14)))  # 13 tokens: 3 full blocks + 1 partial
    _compute_prompt(kv, a)
    full, partial = a.block_ids[:3], a.block_ids[3]
    kv.free(a)
    order = free_block_ids(kv)
    assert order[0] == partial  # holds nothing reusable: reused first
    assert list(order[-3:]) == full[::-1]  # cached: the tail, last block nearest the head
    newcomer = _request("n", [50 + i for i in range(4 * 6)])  # needs 6 of 8 free blocks
    assert kv.allocate(newcomer, newcomer.num_tokens)
    assert kv.blocks[full[2]].block_hash is None and kv.blocks[full[0]].block_hash is not None
    again = _request("b", list(range(1, 14)))
    assert kv.find_cached_blocks(again) == full[:2]  # block 2 was evicted, so the chain ends there


def test_identical_blocks_computed_twice_are_not_merged():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    a, b = _request("a", list(range(1, 10))), _request("b", list(range(1, 10)))
    for request in (a, b):  # admitted in the same step: neither finds the other's blocks
        assert kv.allocate(request, request.num_tokens)
    for request in (a, b):
        request.num_computed_tokens = request.num_tokens
        kv.cache_computed_blocks(request)
    hashed = [bid for bid in a.block_ids + b.block_ids if kv.blocks[bid].block_hash is not None]
    assert hashed == a.block_ids[:2]  # b's copies stay unhashed


def test_different_salts_share_nothing_and_no_salt_is_its_own_tenant():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    prompt = list(range(1, 14))
    _compute_prompt(kv, _request("a", prompt, salt="tenant-a"))
    assert kv.find_cached_blocks(_request("b", prompt, salt="tenant-b")) == []
    assert kv.find_cached_blocks(_request("c", prompt)) == []
    assert len(kv.find_cached_blocks(_request("d", prompt, salt="tenant-a"))) == 3


def test_with_caching_off_nothing_is_found():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=False)
    _compute_prompt(kv, _request("a", list(range(1, 14))))
    assert kv.find_cached_blocks(_request("b", list(range(1, 14)))) == []
    assert not any(block.block_hash for block in kv.blocks)


# -- prompt logprobs from the cache, and a prefix being computed -------------------------------


def _scoring(request_id: str, prompt: list[int], num_top: int = 1) -> Request:
    """A request as an evaluation harness sends one: it wants its prompt's logprobs."""
    return Request(request_id, list(prompt), SamplingParams(max_tokens=1, prompt_logprobs=num_top))


def _scored(prompt: list[int], num_top: int) -> list[TokenLogprob]:
    """Prompt logprobs as the runner returns them (entry i: token i + 1), made up."""
    return [
        TokenLogprob(token, -i / 8, 1, tuple((token + k, -i / 8 - k) for k in range(num_top)))
        for i, token in enumerate(prompt[1:])
    ]


def test_blocks_keep_the_prompt_logprobs_they_were_computed_with_for_requests_asking_for_them():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    prompt = list(range(1, 11))  # 2 full blocks
    a = _scoring("a", prompt, num_top=2)
    assert kv.allocate(a, a.num_tokens)
    a.num_computed_tokens, a.prompt_logprobs = a.num_tokens, _scored(prompt, 2)
    kv.cache_computed_blocks(a)
    kv.free(a)
    b = _scoring("b", [*prompt, 11], num_top=1)
    hits = kv.find_cached_blocks(b)
    assert len(hits) == 2 and kv.num_hit_tokens(b, 2) == 7  # the hit's last token is recomputed
    assert kv.allocate(b, b.num_tokens - 7, hits)
    assert (b.num_computed_tokens, b.prefix_hit_end) == (7, 8)
    assert b.prompt_logprobs == [replace(entry, top=entry.top[:1]) for entry in _scored(prompt, 2)[:7]]
    assert kv.find_cached_blocks(_scoring("c", prompt, num_top=3)) == []  # more than they kept
    plain = _request("d", prompt)  # no logprobs wanted: the whole hit counts, nothing recomputed
    assert len(kv.find_cached_blocks(plain)) == 2 and kv.num_hit_tokens(plain, 2) == 8
    # Blocks a request computed without prompt logprobs hold none to give
    other = [50 + i for i in range(10)]
    _compute_prompt(kv, _request("e", other))
    assert kv.find_cached_blocks(_scoring("f", other)) == []


def _step(scheduler, record_logprobs: tuple[Request, ...] = ()) -> dict[str, tuple[int, int, int]]:
    """One step; the engine's part for `record_logprobs`: it records their chunks' logprobs. Each
    row's (start, tokens, tokens whose K/V is cached)."""
    batch = scheduler.schedule()
    for request in record_logprobs:
        request.prompt_logprobs = _scored(request.prompt_token_ids, 1)[: request.num_planned_tokens]
    scheduler.update(batch, [5] * len(batch.sampling_rows))
    return {r.request_id: (r.start_position, r.num_tokens, r.num_cached_kv_tokens) for r in batch.rows}


def test_a_waiting_request_waits_for_the_prefix_a_running_one_computes_then_reads_it():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    scheduler = SCHEDULING_POLICIES["stall_free"](SchedulerConfig(64, 8), kv)
    context = list(range(1, 11))
    a, b = _scoring("a", [*context, 20]), _scoring("b", [*context, 30])
    unrelated = _request("u", [70 + i for i in range(6)])
    for request in (a, b, unrelated):
        scheduler.add_request(request)
    # b waits for a's blocks, and the queue behind it goes on ...
    assert _step(scheduler, (a,)) == {"a": (0, 11, 0), "u": (0, 6, 0)}
    # ... then b reads them, recomputing their last token (7) for token 8's logprob (a is done)
    assert _step(scheduler) == {"u": (6, 1, 0), "b": (7, 4, 1)}
    assert b.prompt_logprobs[:7] == a.prompt_logprobs[:7]
    # A request wanting prompt logprobs does not wait for blocks computed without them
    c, d = _request("c", [*context, 40]), _scoring("d", [*context, 50])
    other = [60 + i for i in range(10)]
    c.prompt_token_ids = [*other, 40]
    d.prompt_token_ids = [*other, 50]
    for request in (c, d):
        scheduler.add_request(request)
    assert {k: v for k, v in _step(scheduler).items() if k in "cd"} == {"c": (0, 11, 0), "d": (0, 11, 0)}


def test_a_request_waiting_for_a_prefix_goes_on_when_its_computer_is_aborted():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    scheduler = SCHEDULING_POLICIES["stall_free"](SchedulerConfig(8, 8), kv)  # 2 steps of prefill
    a, b = _request("a", list(range(1, 14))), _request("b", [*range(1, 13), 99])
    for request in (a, b):
        scheduler.add_request(request)
    assert _step(scheduler) == {"a": (0, 8, 0)}
    scheduler.finish_request(a, FinishReason.ABORT)  # the blocks it computed stay cached
    assert _step(scheduler) == {"b": (8, 5, 0)}


# -- random operation sequences through the scheduler ------------------------------------------

PREFIXES = [[7] * 8, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], list(range(20, 40))]


def _check_invariants(kv: KVCacheManager, live: list[Request]) -> None:
    holders: dict[int, int] = {}
    for request in live:
        for block_id in request.block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block in kv.blocks[1:]:
        assert block.ref_count == holders.get(block.block_id, 0), block
        assert (block.block_id in free_block_ids(kv)) == (block.ref_count == 0), block
    hashed = [block.block_hash for block in kv.blocks if block.block_hash is not None]
    assert len(hashed) == len(set(hashed)), "a hash maps to two blocks"
    assert kv.num_free_cached_blocks == sum(
        1 for block_id in free_block_ids(kv) if kv.blocks[block_id].block_hash is not None
    )


def _operations(suffix: st.SearchStrategy, extra: st.SearchStrategy) -> st.SearchStrategy:
    """What a random-operation test does, in turn (1 to 40 of them): add a request, step, or
    abort one (an add or a step three times as often as an abort), each with a prefix's index,
    a suffix and one more drawn value of the test's own."""
    operation = st.sampled_from(["add", "add", "add", "step", "step", "step", "abort"])
    prefix = st.integers(0, len(PREFIXES) - 1)
    return st.lists(st.tuples(operation, prefix, suffix, extra), min_size=1, max_size=40)


def _abort_one(scheduler, pick: int) -> None:
    """Abort the `pick`-th (modulo) of the scheduler's requests, in id order."""
    victim = scheduler.requests[sorted(scheduler.requests)[pick % len(scheduler.requests)]]
    scheduler.finish_request(victim, FinishReason.ABORT)


def _finish_all(scheduler, step: Callable[[], None]) -> None:
    """Step until every request is done: in far fewer steps than this bound, unless one waits for
    ever (parked on a prefix nobody computes), which then fails the test instead of hanging it."""
    for _ in range(5000):
        if not scheduler.has_unfinished_requests():
            return
        step()
    raise AssertionError("a request never finished")


@settings(max_examples=150, deadline=None)
@given(
    _operations(
        st.lists(st.integers(100, 120), min_size=1, max_size=10),  # the suffix
        st.integers(1, 6),  # max_tokens
    ),
    st.integers(6, 24),  # pool size: small enough to preempt and evict
    st.sampled_from([4, 8, 64]),  # token budget: chunks fill blocks mid-prefill
)
def test_random_operations_keep_the_pool_consistent(operations, num_blocks, budget):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True)
    scheduler = SCHEDULING_POLICIES["stall_free"](SchedulerConfig(budget, 8), kv)
    requests: list[Request] = []
    for index, (operation, prefix, suffix, max_tokens) in enumerate(operations):
        if operation == "add":
            prompt = PREFIXES[prefix] + suffix
            if len(prompt) + max_tokens <= num_blocks * BLOCK:
                request = _request(f"r{index}", prompt, max_tokens=max_tokens)
                scheduler.add_request(request)
                requests.append(request)
        elif operation == "abort" and scheduler.requests:
            _abort_one(scheduler, prefix)
        else:
            batch = scheduler.schedule()
            scheduler.update(batch, [5] * len(batch.sampling_rows))
        for request in requests:
            if request.first_scheduled_time is not None:  # admitted: its hit is known
                assert request.num_cached_tokens % BLOCK == 0
                assert request.num_cached_tokens < request.num_prompt_tokens
        _check_invariants(kv, list(scheduler.running))

    def step() -> None:
        scheduler.update(batch := scheduler.schedule(), [5] * len(batch.sampling_rows))
        _check_invariants(kv, list(scheduler.running))

    _finish_all(scheduler, step)
    assert all(request.status is RequestStatus.FINISHED for request in requests)
    assert kv.num_free_blocks == kv.num_blocks
    whole_pool = _request("whole", [200 + i % 50 for i in range(num_blocks * BLOCK)], max_tokens=1)
    assert kv.allocate(whole_pool, whole_pool.num_tokens)  # every block usable again


def _truth(prompt: list[int], position: int, num_top: int) -> TokenLogprob:
    """A made-up prompt logprob of the token at `position`, a function of the tokens up to it (as
    a model's is), so a block's logprobs are the same whoever computed them."""
    key = hash(tuple(prompt[: position + 1])) % 1000
    return TokenLogprob(
        prompt[position], -key / 100, key % 7 + 1, tuple((k, -k / 10) for k in range(num_top))
    )


@settings(max_examples=150, deadline=None)
@given(
    _operations(
        st.lists(st.integers(100, 103), min_size=1, max_size=6),  # the suffix: often the same
        st.sampled_from([None, None, 0, 1, 2]),  # prompt_logprobs
    ),
    st.integers(6, 24),
    st.sampled_from([4, 8, 64]),
)
def test_prompt_logprobs_come_whole_and_right_through_hits_parking_preemption_and_aborts(
    operations, num_blocks, budget
):
    # The engine's part played here: each step's rows that want prompt logprobs get them (made-up
    # values, a function of the prefix) before the update. Every request that finishes has its
    # prompt's logprobs, each once and right; no claim outlives its requests; the pool stays whole.
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True)
    scheduler = SCHEDULING_POLICIES["stall_free"](SchedulerConfig(budget, 8), kv)
    requests: list[Request] = []

    def step() -> None:
        batch = scheduler.schedule()
        for row in batch.rows:
            request = scheduler.requests[row.request_id]
            wanted = row.prompt_logprobs
            if wanted is not None:
                first = row.start_position + wanted.offset + 1
                assert first == len(request.prompt_logprobs) + 1  # each once, in order
                request.prompt_logprobs += [
                    _truth(request.prompt_token_ids, first + i, wanted.num_top)
                    for i in range(len(wanted.targets))
                ]
        scheduler.update(batch, [5] * len(batch.sampling_rows))
        _check_invariants(kv, list(scheduler.running))

    for index, (operation, prefix, suffix, num_top) in enumerate(operations):
        prompt = PREFIXES[prefix] + suffix
        if operation == "add" and len(prompt) + 2 <= num_blocks * BLOCK:
            params = SamplingParams(max_tokens=2, prompt_logprobs=num_top)
            requests.append(Request(f"r{index}", prompt, params))
            scheduler.add_request(requests[-1])
        elif operation == "abort" and scheduler.requests:
            _abort_one(scheduler, prefix)
        elif operation == "step":
            step()
    _finish_all(scheduler, step)
    assert not kv._claimed
    for request in requests:
        num_top = request.sampling_params.prompt_logprobs
        if request.finish_reason is FinishReason.ABORT or num_top is None:
            continue
        prompt = request.prompt_token_ids
        assert request.prompt_logprobs == [_truth(prompt, p, num_top) for p in range(1, len(prompt))]


def test_waiting_requests_are_reported_net_of_what_the_cache_holds_as_they_queue():
    # Routers read the waiting prompt tokens as load a replica has yet to compute: a request whose
    # prefix is cached adds only the rest (else a tenant's queued turns look like full prompts).
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    scheduler = SCHEDULING_POLICIES["stall_free"](SchedulerConfig(64, 8), kv)
    a = _request("a", list(range(1, 18)))  # 17 tokens: 4 full blocks
    _compute_prompt(kv, a)
    kv.free(a)
    b = _request("b", [*range(1, 17), 99, 98])  # shares a's first 16 tokens
    scheduler.add_request(b)
    assert b.num_expected_cached_tokens == 16 and b.num_owed_tokens - b.num_expected_cached_tokens == 2
    # ... and whose prefix a running request is computing, only the rest of that, too
    chunked = SCHEDULING_POLICIES["stall_free"](SchedulerConfig(8, 8), KVCacheManager(16, BLOCK, True))
    c = _request("c", list(range(40, 57)))  # 17 tokens: computed 8 a step
    chunked.add_request(c)
    chunked.update(batch := chunked.schedule(), [5] * len(batch.sampling_rows))  # blocks 0-1 cached
    d = _request("d", [*range(40, 56), 99])  # blocks 2-3: c's, still to compute
    chunked.add_request(d)
    assert d.num_expected_cached_tokens == 16 and chunked.waiting.num_pending_tokens == 1


def test_a_running_request_still_prefilling_reports_the_rest_of_its_prompt_as_pending():
    # Chunked prefill allocates blocks chunk by chunk: the prompt a running request has not yet
    # computed is KV and compute the replica still owes, as a waiting request's prompt is.
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    scheduler = SCHEDULING_POLICIES["stall_free"](SchedulerConfig(8, 8), kv)
    a, b = _request("a", list(range(1, 21))), _request("b", list(range(30, 36)))
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert scheduler.stats().num_pending_prompt_tokens == 20 + 6
    scheduler.update(batch := scheduler.schedule(), [5] * len(batch.sampling_rows))
    assert a.status is RequestStatus.RUNNING and a.num_computed_tokens == 8
    assert scheduler.stats().num_pending_prompt_tokens == 12 + 6
    while a.num_computed_tokens < a.num_prompt_tokens:
        scheduler.update(batch := scheduler.schedule(), [5] * len(batch.sampling_rows))
    assert scheduler.stats().num_pending_prompt_tokens == max(0, 6 - b.num_computed_tokens)


def test_stats_carry_the_running_context_and_the_learned_step_time_for_routers():
    # The kv_prefix router prices a replica's decodes by the context they attend to, in seconds
    # of the replica's own step-time model (its TBT budget's; none without a TBT target).
    from replica_engine.scheduler.step_time_model import StepTimeModel
    from replica_engine.scheduler.token_budget import SLOTokenBudget

    coefficients = (0.01, 1e-3, 2e-4, 1e-7, 1e-6, 1e-4)
    for budget, expected in (
        (None, ()),
        (SLOTokenBudget(StepTimeModel.from_coefficients(coefficients), 0.1), coefficients),
    ):
        kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
        scheduler = SCHEDULING_POLICIES["stall_free"](SchedulerConfig(64, 8), kv, budget)
        scheduler.add_request(_request("a", list(range(1, 21))))
        scheduler.add_request(_request("b", list(range(30, 36))))
        assert scheduler.stats().num_running_context_tokens == 0  # waiting: no decode attention yet
        scheduler.update(batch := scheduler.schedule(), [5] * len(batch.sampling_rows))
        stats = scheduler.stats()
        assert stats.num_running_context_tokens == (20 + 1) + (6 + 1)
        assert stats.step_time_coefficients == expected
