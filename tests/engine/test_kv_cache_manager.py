from common.sampling_params import SamplingParams
from replica_engine.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from replica_engine.request import Request
from tests.engine.scheduler_harness import free_block_ids


def _request(prompt_len: int) -> Request:
    return Request("r", [1] * prompt_len, SamplingParams())


def test_allocates_exactly_the_blocks_for_the_scheduled_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=16)
    request = _request(40)
    assert kv.allocate(request, 17)  # tokens 0..16 -> 2 blocks
    assert len(request.block_ids) == 2
    request.num_computed_tokens = 17
    assert kv.allocate(request, 15)  # up to 32 tokens: still 2 blocks
    assert len(request.block_ids) == 2
    request.num_computed_tokens = 32
    assert kv.allocate(request, 1)  # token 33 opens block 3
    assert len(request.block_ids) == 3
    assert kv.num_free_blocks == 7
    assert abs(kv.usage - 0.3) < 1e-9


def test_refuses_when_short_and_takes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = _request(20)
    assert not kv.allocate(request, 9)  # needs 3
    assert request.block_ids == []
    assert kv.num_free_blocks == 2


def test_free_returns_every_block_and_blocks_are_never_shared():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, b = _request(8), _request(8)
    assert kv.allocate(a, 8) and kv.allocate(b, 8)
    assert not set(a.block_ids) & set(b.block_ids)
    kv.free(a)
    assert a.block_ids == [] and kv.num_free_blocks == 4
    c = _request(16)
    assert kv.allocate(c, 16)
    assert not set(c.block_ids) & set(b.block_ids)
    kv.free(b)
    kv.free(c)
    assert kv.num_free_blocks == 6 and kv.usage == 0.0


def test_the_null_block_is_never_handed_out():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.pool_size == 6 and NULL_BLOCK_ID not in free_block_ids(kv)
    request = _request(20)
    assert kv.allocate(request, 20)  # the whole pool
    assert sorted(request.block_ids) == [1, 2, 3, 4, 5] and kv.num_free_blocks == 0
    kv.free(request)
    assert sorted(free_block_ids(kv)) == [1, 2, 3, 4, 5]


def test_adopted_blocks_are_held_until_admission_and_stop_where_the_pool_runs_short():
    """hold_prefix (prefill/decode disaggregation): a block the cache holds is held as it is, the
    others take free blocks, hashed at once; the pool running short ends the run."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    first = Request("a", list(range(1, 10)), SamplingParams())
    assert kv.allocate(first, 9)
    first.num_computed_tokens = 9
    kv.cache_computed_blocks(first)  # blocks 0 and 1 of this prompt are cached
    kv.free(first)
    adopting = Request("b", list(range(1, 30)), SamplingParams())  # 7 full blocks to adopt
    to_write = kv.hold_prefix(adopting, 7)
    assert [index for index, _ in to_write] == [2, 3]  # two cached, two free blocks, then short
    assert len(adopting.held_block_ids) == 4 and kv.num_free_blocks == 0
    assert kv.find_cached_blocks(adopting) == adopting.held_block_ids  # found by admission
    kv.release_hold(adopting)
    assert kv.num_free_blocks == 4 and kv.num_free_cached_blocks == 4  # free, still cached


def test_blocks_held_for_waiting_requests_never_keep_an_idle_pool_from_admitting():
    """Adopted blocks are held per waiting request until its admission; if the holds of requests
    queued behind the first fill the pool, the first cannot be admitted while nothing runs: the
    scheduler lets every hold go (the blocks stay cached) rather than idle forever."""
    from replica_engine.scheduler import SCHEDULING_POLICIES, SchedulerConfig

    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    scheduler = SCHEDULING_POLICIES["stall_free"](SchedulerConfig(64, 4), kv)
    first = Request("first", list(range(100, 112)), SamplingParams(max_tokens=4))  # needs 3 blocks
    scheduler.add_request(first)
    for index in range(2):  # each holds 3 adopted blocks: 6 of 8 held, 2 left
        later = Request(f"later-{index}", [index + 1] * 13, SamplingParams(max_tokens=4))
        kv.hold_prefix(later, 3)
        scheduler.add_request(later)
    assert kv.num_free_blocks == 2
    batch = scheduler.schedule()
    assert "first" in {row.request_id for row in batch.rows}
    assert all(not request.held_block_ids for request in scheduler.waiting)
