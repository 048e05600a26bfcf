"""The kv_prefix router's parts on hand-built replica reports (pure: no Ray): overlap against
summaries and recent sends, the predicted-TTFT ranking, new prefixes' placement, stale and
missing stats, salted requests, and a burst of one conversation."""

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
from router.prefix_policy import BY_NEW_PREFIX, BY_PREFIX, predicted_ttft, rank_by_prefix
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


def decide(stats: dict, keys: list[bytes], tracker=None):
    tracker = tracker or PressureTracker()
    return rank_by_prefix(tracker, index_of(stats), stats, {}, keys, NOW)


MODEL = (0.01, 0.001, 0.0, 0.0, 0.0, 0.0)  # 10 ms a step, 1 ms a prompt token


def learned(stats: RoutingStats, coefficients=MODEL, **fields) -> RoutingStats:
    return replace(stats, step_time_coefficients=coefficients, **fields)


def test_predicted_ttft_prices_the_queue_the_decodes_and_the_own_prefill_by_the_replicas_model():
    stats = replace(report(90), num_running=56, num_running_context_tokens=1000, max_num_batched_tokens=256)
    coefficients = (0.01, 0.001, 0.0002, 0.5e-6, 1e-6, 0.0001)
    # 400 queued + 100 own tokens at 200 a step (256 - 56 decodes): 3 steps of 10 ms + 56 * 0.2 ms
    # + 1000 pairs * 1 us + 57 * 0.1 ms; 500 prompt tokens at 1 ms; the own 100 tokens after 32
    # cached score 100 * 32 + 5050 pairs at 0.5 us.
    step_s = 0.01 + 56 * 0.0002 + 1000 * 1e-6 + 57 * 0.0001
    own_s = 100 * 0.001 + (3200 + 5050) * 0.5e-6
    ttft_s, own_prefill_s = predicted_ttft(coefficients, stats, queued=400, own=100, own_start=32)
    assert ttft_s == pytest.approx(3 * step_s + 400 * 0.001 + own_s)
    assert own_prefill_s == pytest.approx(own_s)


def test_the_holder_keeps_a_prompt_until_its_queue_costs_more_than_a_moves_prefill():
    # b computes the 160-token prompt (one step: 0.01 + 0.16 s) and delays its one running request
    # by that prefill (0.16 s): 0.33 s. a holds the prompt (1 token to compute: 0.001 s, and as long
    # for its running one): a queue of 310 tokens costs 2 steps + 0.31 s, 0.332 s in all, more than
    # b, yet within b's own prefill (0.16 s) of it: a keeps it, as a move would copy the prompt.
    # 460 tokens: 0.482 s, still within 0.49; 470: 0.492, and b takes it.
    held = {"a": learned(stats_holding(PROMPT)), "b": learned(stats_holding([]))}
    assert decide(held, PROMPT).ranking == [("a", BY_PREFIX), ("b", BY_KV)]
    assert decide(held, PROMPT).overlaps == {"a": 10, "b": 0}
    for waiting_tokens in (310, 460):
        queued = {**held, "a": learned(stats_holding(PROMPT, waiting_tokens=waiting_tokens))}
        assert decide(queued, PROMPT).ranking == [("a", BY_PREFIX), ("b", BY_KV)], waiting_tokens
    queued = {**held, "a": learned(stats_holding(PROMPT, waiting_tokens=470))}
    assert decide(queued, PROMPT).ranking == [("b", BY_KV), ("a", BY_PREFIX)]


def test_requests_already_on_a_replica_make_its_prefill_dearer():
    # Equal queues; a holds half the prompt. Each request running on a replica waits out the
    # prefill of a request sent there, so a busy replica's prefill counts that many times over.
    half = {"a": learned(stats_holding(PROMPT[:5])), "b": learned(stats_holding([]))}
    assert decide(half, PROMPT).ranking[0] == ("a", BY_PREFIX)
    busy = {**half, "a": learned(stats_holding(PROMPT[:5]), num_running=8)}
    assert decide(busy, PROMPT).ranking[0] == ("b", BY_KV)


def test_a_replica_without_a_model_makes_every_replica_priced_in_tokens():
    # Seconds: a's 300 queued tokens take 2 steps of a 1 s step, b's prompt one: b. In tokens
    # (a step costs its decodes, each token 1): a 2 + 300 + 1 + 1, b 1 + 160 + 160: a.
    slow_steps = (1.0, 0.001, 0.0, 0.0, 0.0, 0.0)
    a = stats_holding(PROMPT, waiting_tokens=300)
    both = {"a": learned(a, slow_steps), "b": learned(stats_holding([]), slow_steps)}
    assert decide(both, PROMPT).ranking[0][0] == "b"
    one = {**both, "b": stats_holding([])}
    assert decide(one, PROMPT).ranking[0][0] == "a"


def test_a_prefix_nobody_holds_goes_where_its_first_token_comes_soonest_whatever_runs_there():
    # a runs 40 requests, b 1 and owes 200 prompt tokens: the prompt (160 tokens) starts in a's
    # next step (0.01 + 0.16 s) and after b's queue (2 steps + 0.36 s). Weighing the requests
    # already there, as a held prompt's move is weighed, would send it to b (0.16 s for each of
    # a's 40 against 0.16 for b's one).
    stats = {
        "a": learned(stats_holding([]), num_running=40),
        "b": learned(stats_holding([], waiting_tokens=200)),
    }
    assert decide(stats, PROMPT).ranking[0] == ("a", BY_NEW_PREFIX)


def test_replicas_that_price_alike_give_a_new_prefix_to_the_least_idle_cached_content():
    # Equal load; a's cache holds an idle tenant's 60 blocks, b's 20: a new tenant goes to b.
    stats = {
        "a": learned(stats_holding([]), num_cached_free_blocks=60),
        "b": learned(stats_holding([]), num_cached_free_blocks=20),
    }
    assert decide(stats, PROMPT).ranking[0] == ("b", BY_NEW_PREFIX)
    # Unless b's first token would come later (0.38 s against 0.17).
    stats["b"] = learned(stats_holding([], waiting_tokens=200), num_cached_free_blocks=20)
    assert decide(stats, PROMPT).ranking == [("a", BY_NEW_PREFIX), ("b", BY_KV)]


def test_stale_and_missing_stats_rank_after_fresh_ones_whatever_they_hold():
    stats = {"stale": stats_holding(PROMPT, free=99), "fresh": stats_holding([], free=10), "none": None}
    tracker = PressureTracker()
    tracker.observe("stale", stats["stale"], now=NOW - 10)
    ranking = decide(stats, PROMPT, tracker=tracker).ranking
    assert ranking[0][0] == "fresh" and ("stale", BY_QUEUE) in ranking


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
