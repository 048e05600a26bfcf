"""The simulator's re-implementations of SGLang's sgl-router cache-aware policy and llm-d's precise
prefix-cache scorers replay the decisions their own tests and sources document
(sgl-router/src/policies/cache_aware.rs and tree.rs; llm-d-inference-scheduler's scorer tests),
and run a fleet end to end."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from fleet_sim.fleet import Fleet, FleetConfig
from fleet_sim.llmd_router import LLMDPrecisePrefix, ScorerWeights, prefix_score, queue_scores, total_score
from fleet_sim.records import summarize_records
from fleet_sim.routers import make_router
from fleet_sim.sglang_router import CacheAwareConfig, SGLangCacheAware
from tests.sim.test_fleet import REPLICA, STEP_TIME, tenants_workload

RUST_DEFAULTS = CacheAwareConfig(cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1)


def sglang(config: CacheAwareConfig, workers: list[str]) -> SGLangCacheAware:
    router = SGLangCacheAware(random.Random(0), config)
    router.join(workers, now=0.0)
    return router


def load(router: SGLangCacheAware, worker: str, requests: int, text: str = "") -> None:
    for i in range(requests):
        router.dispatched(f"{worker}-{i}", text, worker, now=0.0)


def test_sglang_sends_everything_to_the_least_loaded_worker_when_imbalanced():
    # cache_aware.rs test_cache_aware_with_imbalanced_load: abs 5, rel 2; loads 20 and 0.
    router = sglang(CacheAwareConfig(balance_abs_threshold=5, balance_rel_threshold=2.0), ["w1", "w2"])
    load(router, "w1", 20)
    for i in range(5):
        assert router.choose("test", ["w1", "w2"]) == "w2"
        router.dispatched(f"t{i}", "test", "w2", now=1.0)
        router.completed(f"t{i}")  # its load falls back; the tree keeps the text


def test_sglang_follows_the_worker_whose_tree_matches_when_balanced():
    # test_cache_aware_with_balanced_load: a prompt, the same again, then a prefix of it (a
    # partial node counts its shared characters: 5 of 5).
    router = sglang(RUST_DEFAULTS, ["w1", "w2"])
    first = router.choose("hello world", ["w1", "w2"])
    router.dispatched("r0", "hello world", first, now=0.0)
    assert router.choose("hello world", ["w1", "w2"]) == first
    assert router.choose("hello", ["w1", "w2"]) == first


def test_sglang_sends_a_miss_to_the_least_loaded_worker_not_the_smallest_tree():
    # test_prove_cache_aware_overload_flaw, as PR #14650 changed it: balanced (50 <= 100), no match.
    router = sglang(
        CacheAwareConfig(cache_threshold=0.5, balance_abs_threshold=100, balance_rel_threshold=10),
        ["busy", "idle"],
    )
    load(router, "busy", 50, "short")
    router.dispatched("x", "x" * 1000, "idle", now=0.0)
    router.completed("x")
    assert router.choose("new_unique_prompt", ["busy", "idle"]) == "idle"


def test_sglang_balance_thresholds_are_strict():
    # The command line's defaults, abs 64 and rel 1.5: loads 100 and 36 differ by 64, not more.
    router = sglang(CacheAwareConfig(), ["a", "b"])
    load(router, "a", 100, "tenant prompt")
    load(router, "b", 36)
    assert router.choose("tenant prompt", ["a", "b"]) == "a"  # balanced: the match wins
    load(router, "a", 1, "tenant prompt")
    assert router.choose("tenant prompt", ["a", "b"]) == "b"  # imbalanced: least loaded


def test_sglang_evicts_each_workers_tree_least_recently_used_first():
    # tree.rs test_simple_eviction: t2's older "hello" goes, its "world" and t1's "hello" stay.
    router = sglang(CacheAwareConfig(max_tree_size=5, eviction_interval_s=10.0), ["t1", "t2"])
    router.dispatched("a", "hello", "t1", now=1.0)
    router.dispatched("b", "hello", "t2", now=2.0)
    router.dispatched("c", "world", "t2", now=3.0)
    router.evict_if_due(now=9.0)  # not due yet
    assert router.tree.tenant_to_char_count == {"t1": 5, "t2": 10}
    router.evict_if_due(now=10.0)
    assert router.tree.tenant_to_char_count == {"t1": 5, "t2": 5}
    assert router.tree.prefix_match("world", ["t2"]) == ("world", ["t2"])
    assert router.tree.prefix_match("hello", ["t2"])[0] == ""


def test_llmd_queue_and_prefix_scores_as_its_scorers_compute_them():
    assert queue_scores([10, 5, 0]) == [0.0, 0.5, 1.0]  # queue_test.go
    assert queue_scores([5, 5]) == [1.0, 1.0]
    assert (
        prefix_score(1, 2) == 0.5 and prefix_score(2, 3) == pytest.approx(2 / 3) and prefix_score(0, 0) == 0.0
    )


def test_llmd_weights_decide_between_a_cache_and_an_idle_pod():
    # A holds the whole prompt but is busy (queue 10, KV 90% used); B holds nothing, idle, 10% used.
    # The precise configuration's 2/1/1 keeps A (2.1 against 1.9); the older 3/2/2 picks B (3.2, 3.8).
    shipped, older = ScorerWeights(), ScorerWeights(prefix=3.0, kv_cache_utilization=2.0, queue=2.0)
    assert total_score(shipped, 1.0, 0.9, 0.0) == pytest.approx(2.1)
    assert total_score(shipped, 0.0, 0.1, 1.0) == pytest.approx(1.9)
    assert total_score(older, 1.0, 0.9, 0.0) == pytest.approx(3.2)
    assert total_score(older, 0.0, 0.1, 1.0) == pytest.approx(3.8)

    # The router itself, on stand-ins for simulated replicas (it reads their config, stats and
    # whether each prompt block is cached there).
    def pod(name: str, holds: bool, waiting: int, usage: float) -> SimpleNamespace:
        stats = SimpleNamespace(num_waiting=waiting, kv_cache_usage=usage)
        return SimpleNamespace(
            replica_id=name, config=REPLICA, stats=lambda: stats, holds_block=lambda key: holds
        )

    request = tenants_workload(seed=0, num_tenants=1, num_requests=1, rate=1.0)[0]
    pods = [pod("A", True, 10, 0.9), pod("B", False, 0, 0.1)]
    assert LLMDPrecisePrefix(random.Random(0)).rank(request, pods, 0.0)[0].replica_id == "A"
    assert LLMDPrecisePrefix(random.Random(0), older).rank(request, pods, 0.0)[0].replica_id == "B"


@pytest.mark.parametrize("router", ["sglang_cache_aware", "llmd_precise_prefix"])
def test_a_fleet_routed_by_a_baseline_serves_every_request_and_keeps_tenants_cached(router):
    requests = tenants_workload(seed=2, num_tenants=4, num_requests=160, rate=10.0)
    records = Fleet(FleetConfig(4, REPLICA), STEP_TIME, make_router(router, 0)).run(requests)
    assert all(record.is_finished for record in records)
    assert summarize_records(records)["hit_rate"] > 0.8
