"""Routing by LoRA adapter on hand-built replica reports (pure: no Ray started): the adapters in a
report, holders first unless overloaded, a burst of one adapter, base-model requests unchanged,
and prefix matching from the adapter's chain root."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import prometheus_client
import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest

from common.block_hash import adapter_root, chain_block_hashes, root_hash
from common.block_summary import BlockSummary
from common.lora import LoRARequest
from common.messages import EmbedRequest, GenerateRequest
from common.metrics_sinks import PrometheusSink
from common.routing_stats import MalformedRoutingStats, RoutingReporter, RoutingStats
from common.sampling_params import SamplingParams
from router.adapter_affinity import BY_ADAPTER
from router.kv_router import KVPressureRouter, routed_request
from router.prefix_policy import BY_PREFIX
from router.pressure import BY_KV, BY_QUEUE
from router.ranking import PrefixRanking, PressureRanking, RoutedRequest
from tests.fleet.test_router import report

NOW = 1000.0
ROOT = root_hash("model", None)
SQL = LoRARequest("sql", "/adapters/sql")


def holding(
    *adapters: str, free: int = 90, seq: int = 0, running: int = 1, waiting_tokens: int = 0
) -> RoutingStats:
    stats = report(free, seq=seq, waiting_tokens=waiting_tokens)
    return replace(stats, num_running=running, lora_adapters=adapters)


def request(request_id: str = "r", lora: LoRARequest | None = SQL, prompt: tuple = ()) -> RoutedRequest:
    return RoutedRequest(request_id, 64, prompt, None, lora)


def rank(ranking: PressureRanking, stats: dict, req: RoutedRequest, now: float = NOW) -> list:
    for replica, replica_stats in stats.items():
        if replica_stats is not None:
            ranking.observe(replica, replica_stats, now)
    return ranking.rank(stats, {}, req, now)


def test_a_report_carries_the_adapters_and_a_malformed_list_is_rejected_naming_the_field():
    stats = holding("sql", "chat", seq=3)
    wire = stats.to_report()
    assert wire["lora_adapters"] == ["sql", "chat"]  # a plain list: the controller never imports ours
    assert RoutingStats.from_report(wire) == stats
    for bad in (
        {k: v for k, v in wire.items() if k != "lora_adapters"},  # an older replica's: seen, not guessed
        {**wire, "lora_adapters": "sql"},
        {**wire, "lora_adapters": ["sql", 3]},
        {**wire, "lora_adapters": [""]},
    ):
        with pytest.raises(MalformedRoutingStats, match="lora_adapters"):
            RoutingStats.from_report(bad)


def test_a_replica_reports_the_adapters_its_engine_holds():
    pool = SimpleNamespace(
        num_total_blocks=8,
        num_free_blocks=8,
        num_cached_free_blocks=0,
        num_pending_prompt_tokens=0,
        num_waiting=0,
        num_running=0,
        cached_block_hashes=(),
        lora_adapters=("chat", "sql"),
        num_running_context_tokens=0,
        step_time_coefficients=(),
    )
    assert RoutingReporter(16, ROOT, 256).report(pool, 0).lora_adapters == ("chat", "sql")


@pytest.mark.parametrize("make", [PressureRanking, PrefixRanking])
def test_an_adapter_request_goes_to_a_holder_though_another_replica_is_less_loaded(make):
    stats = {"idle": holding(free=95), "holder": holding("sql", free=60), "other": holding("chat", free=90)}
    ranked = rank(make(), stats, request())
    assert ranked[0] == ("holder", BY_ADAPTER)
    assert [replica for replica, _ in ranked[1:]] == ["idle", "other"]  # then by load, as before
    # A base-model request is ranked as it always was.
    assert rank(make(), stats, request(lora=None))[0] == ("idle", BY_KV)


@pytest.mark.parametrize("make", [PressureRanking, PrefixRanking])
def test_an_overloaded_holder_passes_the_request_on_by_load(make):
    # Too busy by the load guard's rule: 40 more requests than the least busy, and over 1.5x.
    busy = {"holder": holding("sql", free=60, running=45), "idle": holding(running=5)}
    assert rank(make(), busy, request())[0] == ("idle", BY_KV)
    # Within the guard's slack it stays.
    near = {"holder": holding("sql", free=60, running=30), "idle": holding(running=5)}
    assert rank(make(), near, request())[0] == ("holder", BY_ADAPTER)
    # A full KV pool (its queue would wait for blocks) while another has room.
    full = {"holder": holding("sql", free=0, waiting_tokens=16 * 10), "idle": holding()}
    assert rank(make(), full, request())[0] == ("idle", BY_KV)
    # Two holders: the one not overloaded.
    two = {"busy": holding("sql", running=45), "calm": holding("sql", free=50), "idle": holding(running=5)}
    assert rank(make(), two, request())[0] == ("calm", BY_ADAPTER)


def test_a_late_holder_still_draws_its_adapter_until_it_may_be_gone():
    ranking = PressureRanking()
    stats = {"holder": holding("sql", free=10, seq=1), "b": holding(free=50, seq=1)}
    rank(ranking, stats, request(), now=NOW)
    # The holder's reports are late (a loaded host): too old to rank its KV pressure, not too old to
    # say what it holds.
    later = {"holder": stats["holder"], "b": holding(free=50, seq=2)}
    assert rank(ranking, later, request("r2"), now=NOW + 5) == [("holder", BY_ADAPTER), ("b", BY_KV)]
    assert rank(ranking, later, request("r3", lora=None), now=NOW + 5) == [("b", BY_KV), ("holder", BY_QUEUE)]
    # Silent past Serve's health-check period, it may be gone: passed over.
    gone = {"holder": stats["holder"], "b": holding(free=50, seq=3)}
    assert rank(ranking, gone, request("r4"), now=NOW + 11) == [("b", BY_KV), ("holder", BY_QUEUE)]
    # A fresh holder ranks before a late one.
    two = {"holder": stats["holder"], "b": holding("sql", free=50, seq=4)}
    assert rank(ranking, two, request("r5"), now=NOW + 6)[:1] == [("b", BY_ADAPTER)]


def test_a_burst_of_a_new_adapter_follows_its_first_request_until_a_report_lists_it():
    ranking = PressureRanking()
    stats = {"a": holding(free=90), "b": holding(free=91)}
    first = rank(ranking, stats, request("r0"))[0][0]
    ranking.on_routed(request("r0"), first, stats[first], NOW)
    chosen = [rank(ranking, stats, request(f"r{i}"), NOW + 0.01 * i)[0][0] for i in range(1, 6)]
    assert chosen == [first] * 5  # by load alone they would alternate
    # Once reports arrive the replica's own list rules: evicted there, it is no holder after the TTL.
    ttl = ranking.adapters.recent_ttl_s
    evicted = {first: holding("chat", seq=1), ("b" if first == "a" else "a"): holding(seq=1)}
    assert rank(ranking, evicted, request("r9"), NOW + ttl + 1)[0][1] == BY_KV


def test_adapter_affinity_can_be_switched_off_for_baselines():
    stats = {"idle": holding(free=95), "holder": holding("sql", free=60)}
    assert rank(PressureRanking(adapter_policy=None), stats, request())[0] == ("idle", BY_KV)


def test_prefix_matching_hashes_an_adapter_request_from_the_adapters_root():
    prompt = tuple(range(64))  # 4 blocks
    keys = chain_block_hashes(adapter_root(ROOT, SQL), prompt, 16)
    base_keys = chain_block_hashes(ROOT, prompt, 16)
    summary = BlockSummary.of(keys, capacity=256)
    # Both hold the adapter; only one holds its prefix, another the base model's same tokens.
    stats = {
        "prefix": replace(holding("sql", free=80), block_summary=summary),
        "base": replace(holding("sql", free=90), block_summary=BlockSummary.of(base_keys, capacity=256)),
    }
    ranking = PrefixRanking()
    ranked = rank(ranking, stats, request(prompt=prompt))
    assert ranked[0] == ("prefix", BY_ADAPTER)
    routed = ranking.on_routed(request(prompt=prompt), "prefix", stats["prefix"], NOW)
    assert routed.overlap_tokens == 64
    # Without the adapter held anywhere, the prefix still leads.
    no_holder = {r: replace(s, lora_adapters=()) for r, s in stats.items()}
    assert rank(PrefixRanking(), no_holder, request("r2", prompt=prompt))[0] == ("prefix", BY_PREFIX)


def test_the_serve_router_reads_the_adapter_of_a_generate_request():
    generate = GenerateRequest("g", [[1, 2, 3]], [SamplingParams(max_tokens=8, lora=SQL)])
    embed = EmbedRequest("e", [[1, 2, 3]])
    router = KVPressureRouter(DeploymentID("EngineReplica", "app"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(sink=PrometheusSink(prometheus_client.CollectorRegistry()))
    # Stand-ins for Serve's RunningReplica: the router reads only these two attributes.
    replicas = [
        SimpleNamespace(replica_id="idle", routing_stats=holding(free=95).to_report()),
        SimpleNamespace(replica_id="holder", routing_stats=holding("sql", free=60).to_report()),
    ]

    async def choose() -> str:  # a PendingRequest needs a running event loop
        metadata = RequestMetadata(request_id="g", internal_request_id="g")
        assert routed_request(PendingRequest([generate], {}, metadata)).lora == SQL
        assert routed_request(PendingRequest([embed], {}, metadata)).lora is None
        ranks = await router.choose_replicas(replicas, PendingRequest([generate], {}, metadata))
        return ranks[0][0].replica_id

    assert asyncio.run(choose()) == "holder"
