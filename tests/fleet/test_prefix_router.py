"""The kv_prefix router's parts on hand-built replica reports (pure: no Ray): overlap against
summaries and recent sends, the cost ranking, the load guard, stale and missing stats, salted
requests, and a burst of one conversation."""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import replace
from types import SimpleNamespace

import prometheus_client
import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest

from common.block_hash import chain_block_hashes, root_hash
from common.block_summary import BlockSummary
from common.messages import GenerateRequest
from common.metrics_sinks import PrometheusSink
from common.routing_stats import RoutingStats
from common.sampling_params import SamplingParams
from router.prefix_index import PrefixIndex
from router.prefix_policy import BY_LOAD_GUARD, BY_PREFIX, PrefixPolicy, rank_by_prefix
from router.prefix_router import KVPrefixRouter
from router.pressure import BY_KV, BY_QUEUE, PressureTracker
from tests.fleet.test_router import report

NOW = 1000.0
ROOT = root_hash("model", None)


def chain(token_ids: list[int]) -> list[bytes]:
    return chain_block_hashes(ROOT, token_ids, 16)


def stats_holding(keys: list[bytes], seq: int = 0, free: int = 90, **load: int) -> RoutingStats:
    summary = BlockSummary.of(keys, capacity=256)
    return replace(report(free, seq=seq, **load), block_summary=summary, hash_root=ROOT)


def index_of(stats: dict) -> PrefixIndex:
    index = PrefixIndex()
    for replica, replica_stats in stats.items():
        if replica_stats is not None:
            index.observe(replica, replica_stats)
    return index


PROMPT = chain(list(range(160)))  # 10 blocks


def test_overlap_counts_the_leading_blocks_up_to_the_first_one_missing():
    index = index_of(
        {
            "gap": stats_holding(PROMPT[:4] + PROMPT[5:]),
            "all": stats_holding(PROMPT),
            "none": stats_holding([]),
            "other": stats_holding(chain(list(range(1000, 1160)))),
        }
    )
    overlaps = {replica: index.overlap(replica, PROMPT, NOW) for replica in ("gap", "all", "none", "other")}
    assert overlaps == {"gap": 4, "all": 10, "none": 0, "other": 0}
    assert index.overlap("never-reported", PROMPT, NOW) == 0 and index.overlap("all", [], NOW) == 0


def test_what_the_router_sent_counts_until_a_report_holds_it_or_it_expires():
    index = index_of({"a": stats_holding([], seq=0)})
    index.on_sent("a", PROMPT[:6], now=NOW)
    assert index.overlap("a", PROMPT, now=NOW + 1) == 6
    index.observe("a", stats_holding(PROMPT[:6], seq=1))  # now the summary covers them
    assert index.overlap("a", PROMPT, now=NOW + 1) == 6
    index.on_sent("a", PROMPT, now=NOW + 2)
    index.observe("a", stats_holding([], seq=2))  # evicted, and nothing computed yet
    assert index.overlap("a", PROMPT, now=NOW + 3) == 10  # the sent prompt still counts ...
    assert index.overlap("a", PROMPT, now=NOW + 2 + index.recent_ttl_s + 0.1) == 0  # ... for a while


def test_a_restarted_replica_is_forgotten():
    index = index_of({"a": stats_holding(PROMPT)})
    index.keep_only(["b"])
    assert index.overlap("a", PROMPT, NOW) == 0


# Dynamo's weight and the earlier slack: the cost formula's tests below compute by hand with these.
DYNAMO = PrefixPolicy(prefill_weight=1.0, request_slack=8)


def decide(stats: dict, keys: list[bytes], policy: PrefixPolicy | None = None, tracker=None):
    tracker = tracker or PressureTracker()
    return rank_by_prefix(policy or PrefixPolicy(), tracker, index_of(stats), stats, {}, keys, NOW)


def test_the_replica_holding_the_prompt_wins_unless_its_load_outweighs_the_prefill_saved():
    # cost = prefill blocks + used blocks + new blocks. Equal load (10 used): a 0 + 10, b 10 + 10 + 10.
    held = {"a": stats_holding(PROMPT, free=90), "b": stats_holding([], free=90)}
    assert decide(held, PROMPT, DYNAMO).ranking == [("a", BY_PREFIX), ("b", BY_KV)]
    assert decide(held, PROMPT, DYNAMO).overlaps == {"a": 10, "b": 0}
    # a holds 19 blocks more than b: 29 < 30, still a; 21 more: 31 > 30, b.
    busier = {**held, "a": stats_holding(PROMPT, free=71)}
    assert decide(busier, PROMPT, DYNAMO).ranking[0] == ("a", BY_PREFIX)
    busier = {**held, "a": stats_holding(PROMPT, free=69)}
    assert decide(busier, PROMPT, DYNAMO).ranking[0] == ("b", BY_KV)
    # A heavier prefill weight keeps it on a (b: 20 + 10 + 10).
    heavy = PrefixPolicy(prefill_weight=2.0, request_slack=8)
    assert decide({**held, "a": stats_holding(PROMPT, free=69)}, PROMPT, heavy).ranking[0][0] == "a"
    # The default weight (16) saves 17 blocks per block held: 170 for this prompt, more than this
    # 100-block pool's whole load.
    assert decide({**held, "a": stats_holding(PROMPT, free=0)}, PROMPT).ranking[0] == ("a", BY_PREFIX)


def test_a_prefix_nobody_holds_goes_where_less_idle_content_would_be_crowded_out():
    # Equal load; a's cache holds an idle tenant's 60 blocks, b's holds 20: a new tenant goes to b.
    stats = {
        "a": replace(stats_holding([], free=90), num_cached_free_blocks=60),
        "b": replace(stats_holding([], free=90), num_cached_free_blocks=20),
    }
    assert decide(stats, PROMPT, DYNAMO).ranking[0] == ("b", BY_KV)
    # but the tenant's own idle prefix keeps it there (held blocks save 2 each, cost 0.5): a 0 +
    # 10 used + 0.5 * 50 = 35 against b's 10 + 10 + 10 + 0.5 * 20 = 40
    stats["a"] = replace(stats_holding(PROMPT, free=90), num_cached_free_blocks=50)
    assert decide(stats, PROMPT, DYNAMO).ranking[0] == ("a", BY_PREFIX)


def test_with_no_overlap_anywhere_it_ranks_as_kv_pressure():
    stats = {
        "a": stats_holding([], free=20),
        "b": stats_holding([], free=70),
        "c": stats_holding([], free=60),
    }
    assert decide(stats, PROMPT).ranking == PressureTracker().rank(list(stats), stats, {}, NOW)


def test_the_load_guard_sends_a_hot_prefix_elsewhere_when_its_holder_is_much_busier():
    policy = PrefixPolicy(prefill_weight=100.0, request_slack=8)  # the prefix alone would always win
    idle = stats_holding([], free=90)  # 1 running request
    busy = {"a": replace(stats_holding(PROMPT, free=90), num_running=10), "b": idle}
    assert decide(busy, PROMPT, policy).ranking[0] == ("b", BY_LOAD_GUARD)
    # within the slack (8 requests more) it stays with the prefix ...
    near = {**busy, "a": replace(busy["a"], num_running=9)}
    assert decide(near, PROMPT, policy).ranking[0] == ("a", BY_PREFIX)
    # ... and within 50% of the least busy one's count, however many more that is
    crowded = {"a": replace(busy["a"], num_running=30), "b": replace(idle, num_running=21)}
    assert decide(crowded, PROMPT, policy).ranking[0] == ("a", BY_PREFIX)
    # KV load alone never trips it: the cost weighs it
    full = {**busy, "a": stats_holding(PROMPT, free=20)}
    assert decide(full, PROMPT, policy).ranking[0] == ("a", BY_PREFIX)


def test_stale_and_missing_stats_rank_after_fresh_ones_whatever_they_hold():
    stats = {"stale": stats_holding(PROMPT, free=99), "fresh": stats_holding([], free=10), "none": None}
    tracker = PressureTracker()
    tracker.observe("stale", stats["stale"], now=NOW - 10)
    ranking = decide(stats, PROMPT, tracker=tracker).ranking
    assert ranking[0] == ("fresh", BY_KV) and ("stale", BY_QUEUE) in ranking


REQUEST_IDS = itertools.count()


def make_router() -> KVPrefixRouter:
    router = KVPrefixRouter(DeploymentID("EngineReplica", "app"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(sink=PrometheusSink(prometheus_client.CollectorRegistry()))
    return router


def route(router: KVPrefixRouter, replicas: list, prompts: list[list[int]], salt: str | None = None) -> list:
    async def choose() -> list:
        chosen = []
        for prompt in prompts:
            i = next(REQUEST_IDS)
            params = [SamplingParams(max_tokens=16, cache_salt=salt)]
            metadata = RequestMetadata(request_id=f"r{i}", internal_request_id=f"r{i}")
            ranks = await router.choose_replicas(
                replicas, PendingRequest([GenerateRequest(f"r{i}", [prompt], params)], {}, metadata)
            )
            chosen.append(ranks[0][0].replica_id)
        return chosen

    return asyncio.run(choose())


def router_over(stats: dict[str, dict]) -> tuple[KVPrefixRouter, list]:
    """A router that has seen these replicas' reports (stand-ins for Serve's RunningReplica: the
    router reads only replica_id and routing_stats)."""
    replicas = [SimpleNamespace(replica_id=name, routing_stats=s.to_report()) for name, s in stats.items()]
    router = make_router()
    router.observe_reports(replicas)
    return router, replicas


def test_the_router_follows_the_reported_blocks_and_a_burst_of_one_conversation_stays_together():
    tokens = list(range(160))
    router, replicas = router_over({"a": stats_holding([], free=90), "b": stats_holding(PROMPT, free=90)})
    assert route(router, replicas, [[*tokens, 7, 7, 7]]) == ["b"]
    # A burst of a new conversation (nothing cached anywhere): after the first, the rest follow it
    # (the router counts what it just sent), within the load guard's slack.
    fresh = list(range(5000, 5000 + 320))
    burst = route(router, replicas, [[*fresh, i] for i in range(4)])
    assert len(set(burst)) == 1


def test_salted_requests_are_routed_by_load_alone():
    tokens = list(range(160))
    stats = {"a": stats_holding([], free=60), "b": stats_holding(PROMPT, free=59)}
    router, replicas = router_over(stats)
    assert route(router, replicas, [[*tokens, 1]], salt="tenant-1") == ["a"]
    router, replicas = router_over(stats)
    assert route(router, replicas, [[*tokens, 1]]) == ["b"]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_prompts_overlap_exactly_their_shared_prefix(seed):
    rng = random.Random(seed)
    shared = [rng.randrange(49152) for _ in range(16 * rng.randint(1, 20))]
    held_prompt = shared + [rng.randrange(49152) for _ in range(16 * 5)]
    asked = shared + [rng.randrange(49152) for _ in range(16 * 5)]
    index = index_of({"a": stats_holding(chain(held_prompt))})
    assert index.overlap("a", chain(asked), NOW) == len(shared) // 16
