"""The router's ranking and the autoscaling policy's arithmetic, on made-up replica reports
(pure functions: no Ray needed)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import prometheus_client
import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from common.block_hash import root_hash
from common.block_summary import BlockSummary
from common.messages import GenerateRequest
from common.metrics_sinks import PrometheusSink
from common.routing_stats import MalformedRoutingStats, RoutingStats
from common.sampling_params import SamplingParams
from router.autoscaling import FleetLoad, KVPressurePolicy
from router.kv_router import MALFORMED_METRIC, KVPressureRouter
from router.pressure import (
    BY_KV,
    BY_QUEUE,
    MAX_IN_FLIGHT_S,
    NO_STATS,
    REPORT_LAG_S,
    PressureTracker,
)

NOW = 1000.0


def report(
    free: int, total: int = 100, waiting_tokens: int = 0, seq: int = 0, block_size: int = 16
) -> RoutingStats:
    """A replica's report that holds no cached blocks."""
    return RoutingStats(
        num_total_blocks=total,
        num_free_blocks=free,
        num_cached_free_blocks=0,
        num_pending_prompt_tokens=waiting_tokens,
        num_waiting=0,
        num_running=1,
        block_size=block_size,
        report_seq=seq,
        block_summary=BlockSummary.of([], capacity=total),
        hash_root=root_hash("model", None),
    )


def test_fresh_replicas_rank_by_kv_pressure_including_their_queues_prompts():
    stats = {"a": report(free=20), "b": report(free=70), "c": report(free=60, waiting_tokens=16 * 30)}
    # a: 80 blocks used; b: 30; c: 40 used + 30 blocks of queued prompts = 70.
    assert PressureTracker().rank(["a", "b", "c"], stats, {}, now=NOW) == [
        ("b", BY_KV),
        ("c", BY_KV),
        ("a", BY_KV),
    ]


def test_stale_and_missing_stats_rank_after_fresh_ones_by_queue_length():
    stats = {"fresh": report(free=1), "stale": report(free=99), "old": report(free=99)}
    tracker = PressureTracker()
    for replica in ("stale", "old"):  # last heard from 10 s ago
        tracker.observe(replica, stats[replica], now=NOW - 10)
    ranking = tracker.rank(
        ["none", "stale", "fresh", "old"], stats, {"stale": 5, "old": 2, "none": 0}, now=NOW
    )
    assert ranking == [("fresh", BY_KV), ("none", NO_STATS), ("old", BY_QUEUE), ("stale", BY_QUEUE)]


def test_a_burst_on_stale_stats_and_equal_queues_spreads_by_this_routers_own_requests():
    # A loaded host delays reports past STALE_AFTER_S, and Serve's cached queue lengths do not
    # move within a burst: the requests this router sent and has not seen finish break the tie.
    stats = {"a": report(free=99), "b": report(free=99)}
    tracker = PressureTracker()
    for replica in stats:
        tracker.observe(replica, stats[replica], now=NOW - 10)
    for queue_lens in ({}, {"a": 0, "b": 0}):
        chosen = []
        for i in range(6):
            best, reason = tracker.rank(["a", "b"], stats, queue_lens, now=NOW)[0]
            assert reason == BY_QUEUE
            tracker.on_sent(f"{queue_lens}-{i}", best, 16, now=NOW)
            chosen.append(best)
        assert sorted(chosen) == ["a"] * 3 + ["b"] * 3
        for i in range(6):
            tracker.on_finished(f"{queue_lens}-{i}", now=NOW)


def test_a_report_is_dated_by_its_arrival_on_the_routers_clock():
    # No replica clock is read: a report is fresh from when this router first saw its number,
    # however far the replica's own clock is from this router's.
    tracker = PressureTracker()
    tracker.observe("a", report(free=50, seq=7), now=NOW)
    assert tracker.reason("a", report(free=50, seq=7), now=NOW + 1.9) == BY_KV
    assert tracker.reason("a", report(free=50, seq=7), now=NOW + 2.1) == BY_QUEUE
    assert tracker.reason("a", report(free=48, seq=8), now=NOW + 2.2) == BY_KV  # a new one
    tracker.keep_only(["b"])  # a is gone: its report is forgotten
    assert tracker.reason("a", report(free=48, seq=8), now=NOW + 9) == BY_KV


def test_a_report_round_trips_and_a_malformed_one_is_rejected_naming_the_field():
    stats = report(free=50, waiting_tokens=33, seq=7)
    assert RoutingStats.from_report(stats.to_report()) == stats
    timed = replace(stats, step_time_coefficients=(0.01, 1e-3, 0.0, 1e-7, 1e-6, 1e-4))
    assert RoutingStats.from_report(timed.to_report()) == timed
    assert RoutingStats.from_report(None) is None and RoutingStats.from_report({}) is None  # not yet
    wire = stats.to_report()
    renamed = {("num_free" if k == "num_free_blocks" else k): v for k, v in wire.items()}
    for bad, field in [
        (renamed, "num_free_blocks"),
        ({**wire, "block_size": 0}, "block_size"),
        ({**wire, "num_running": "1"}, "num_running"),
        ({**wire, "report_seq": True}, "report_seq"),
        ({**wire, "block_summary_bits": b""}, "block_summary_bits"),
        ({**wire, "block_hash_root": None}, "block_hash_root"),
        ({**wire, "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({**wire, "step_time_coefficients": [0.01, 0.001]}, "step_time_coefficients"),
        ({**wire, "step_time_coefficients": [0.01, -1.0, 0, 0, 0, 0]}, "step_time_coefficients"),
        ({**wire, "step_time_coefficients": [float("nan"), 0, 0, 0, 0, 0]}, "step_time_coefficients"),
    ]:
        with pytest.raises(MalformedRoutingStats, match=field):
            RoutingStats.from_report(bad)


def test_a_malformed_report_is_logged_and_counted_once_and_the_replica_ranked_without_stats(caplog):
    registry = prometheus_client.CollectorRegistry()
    router = KVPressureRouter(DeploymentID("EngineReplica", "app"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(sink=PrometheusSink(registry))
    bad_id = ReplicaID("bad", DeploymentID("EngineReplica", "app"))
    bad = SimpleNamespace(
        replica_id=bad_id, routing_stats={**report(free=99).to_report(), "num_free_blocks": -1}
    )
    good = SimpleNamespace(replica_id="good", routing_stats=report(free=1).to_report())
    with caplog.at_level("ERROR", logger="router.kv_router"):
        router.observe_reports([bad, good])
        ranks = asyncio.run(router.choose_replicas([bad, good]))
        router.observe_reports([bad, good])
    assert [rank[0].replica_id for rank in ranks] == ["good", bad_id]  # ranked as no stats: last
    assert router.routed_reason(None, bad_id) == NO_STATS
    assert sum("num_free_blocks" in record.getMessage() for record in caplog.records) == 1

    def malformed_count() -> float | None:
        return registry.get_sample_value(f"{MALFORMED_METRIC}_total", {"target_replica": "bad"})

    assert malformed_count() == 1
    bad.routing_stats = report(free=99, seq=1).to_report()  # mended: read again ...
    router.observe_reports([bad, good])
    bad.routing_stats = {"report_seq": 2}  # ... so a new spell counts again
    router.observe_reports([bad, good])
    assert malformed_count() == 2


def test_the_router_counts_a_burst_on_the_replicas_it_ranks_first_before_any_acceptance():
    # Serve ranks a burst's requests concurrently and reports acceptances later: each choice must
    # see the ones before it, though b's report says it holds one block more than a.
    router = KVPressureRouter(DeploymentID("EngineReplica", "app"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(sink=PrometheusSink(prometheus_client.CollectorRegistry()))
    # Stand-ins for Serve's RunningReplica: the router reads only these two attributes.
    replicas = [
        SimpleNamespace(replica_id="a", routing_stats=report(free=24, total=24).to_report()),
        SimpleNamespace(replica_id="b", routing_stats=report(free=23, total=24).to_report()),
    ]

    async def choose_for_burst() -> list[str]:
        chosen = []
        for i in range(6):
            request = GenerateRequest(f"r{i}", [[1] * 10], [SamplingParams(max_tokens=100)])
            metadata = RequestMetadata(request_id=f"r{i}", internal_request_id=f"r{i}")
            ranks = await router.choose_replicas(replicas, PendingRequest([request], {}, metadata))
            chosen.append(ranks[0][0].replica_id)
        return chosen

    assert asyncio.run(choose_for_burst()) == ["a", "b", "a", "b", "a", "b"]


def test_a_report_counts_the_sends_a_report_lag_before_it_and_unfinished_ones_are_forgotten_in_time():
    tracker = PressureTracker()
    tracker.observe("a", report(free=50, seq=0), now=NOW)
    tracker.on_sent("cancelled-before-accepted", "a", num_tokens=16 * 10, now=NOW + 0.1)
    tracker.on_sent("to-b", "b", num_tokens=16, now=NOW + 0.1)
    # Received just after the send, it may have been taken before: the send still counts on top.
    tracker.observe("a", report(free=50, seq=1), now=NOW + 0.5)
    assert tracker.in_flight_tokens("a") == 16 * 10
    assert tracker.pressure("a", report(free=50, seq=1), now=NOW + 0.5) == (50 + 10) / 100
    tracker.observe("a", report(free=50, seq=2), now=NOW + 0.1 + REPORT_LAG_S)
    assert tracker.in_flight_tokens("a") == 0
    assert tracker.in_flight_tokens("b") == 16
    # never reported finished: dropped once older than MAX_IN_FLIGHT_S (no leak)
    tracker.observe("a", report(free=50, seq=3), now=NOW + MAX_IN_FLIGHT_S + 1)
    assert "cancelled-before-accepted" not in tracker._sent
    assert tracker.unfinished_requests("a") == tracker.unfinished_requests("b") == 0
    assert tracker.in_flight_tokens("b") == 0


def test_a_request_ranked_onto_one_replica_and_routed_to_another_counts_on_the_second_alone():
    tracker = PressureTracker()
    tracker.on_sent("r", "a", num_tokens=32, now=NOW, prefill_tokens=20)
    tracker.on_sent("r", "b", num_tokens=32, now=NOW + 0.01, prefill_tokens=20)  # Serve chose b
    counts = {
        replica: (
            tracker.in_flight_requests(replica),
            tracker.in_flight_tokens(replica),
            tracker.in_flight_prefill_tokens(replica),
            tracker.unfinished_requests(replica),
        )
        for replica in "ab"
    }
    assert counts == {"a": (0, 0, 0, 0), "b": (1, 32, 20, 1)}
    tracker.observe("b", report(free=50, seq=1), now=NOW + 0.01 + REPORT_LAG_S)  # b's report counts it now
    assert (tracker.in_flight_requests("b"), tracker.unfinished_requests("b")) == (0, 1)
    tracker.on_finished("r", now=NOW + 2)
    assert tracker.unfinished_requests("b") == 0 and tracker.freed_tokens("b") == 32


def test_equal_pressure_ties_go_to_the_shorter_queue():
    stats = {"a": report(free=50), "b": report(free=50)}
    assert PressureTracker().rank(["a", "b"], stats, {"a": 3, "b": 1}, now=NOW)[0] == ("b", BY_KV)


def test_requests_count_their_prompt_and_output_tokens():
    params = [SamplingParams(max_tokens=10, n=2), SamplingParams(max_tokens=20, n=2)]
    request = GenerateRequest("r", [[1] * 100, [1, 2, 3]], params)
    assert request.requested_tokens() == 2 * ((100 + 10) + (3 + 20))


@pytest.mark.parametrize(
    ("replicas", "kv_usage", "waiting", "ongoing", "desired"),
    [
        (1, [0.9], [0], 0, 2),  # 0.9 / 0.6 = 1.5 -> 2
        (2, [0.3, 0.3], [0, 0], 0, 1),  # half the target: half the replicas
        (2, [0.6, 0.6], [0, 0], 0, 2),  # on target: stay
        (1, [0.1], [12], 0, 3),  # the queue says more than KV: 12 / 4 = 3
        (2, [0.1, 0.1], [0, 0], 24, 6),  # ongoing requests say more: 24 / 2 / 4 = 3x
        (3, [0.0, 0.0, 0.0], [0, 0, 0], 0, 2),  # idle: at most half go per decision (then min_replicas)
        (16, [0.1] * 16, [0] * 16, 8, 8),  # ~0.17 of 16 asks 3, but half stay: 8
        (2, [], [], 0, 2),  # no reports yet: no change
    ],
)
def test_policy_scales_replicas_by_the_worst_of_kv_usage_queue_depth_and_ongoing_requests(
    replicas, kv_usage, waiting, ongoing, desired
):
    policy = KVPressurePolicy(target_kv_cache_usage=0.6, target_waiting_requests=4, target_ongoing_requests=4)
    assert policy.desired_replicas(replicas, kv_usage, waiting, ongoing) == desired


@pytest.mark.parametrize(
    ("replicas", "kv_usage", "waiting", "ongoing", "load", "desired"),
    [
        # 4 requests/s at 0.5 s of step work each: 2 replicas' worth, at half of each: 4
        (2, [0.1, 0.1], [0, 0], 8, FleetLoad(4.0, 4.0, 2.0), 4),
        # the same, with 30 requests queued: 1 more request/s to drain them in 30 s
        (2, [0.1, 0.1], [20, 10], 38, FleetLoad(4.0, 4.0, 2.0), 5),
        # 200 ongoing requests (a backlog that would ask for 50 replicas) do not count once the
        # rates say what the load is: 2 requests/s at 0.25 s each, 1 replica's worth: 2, but at
        # most half of the 8 go in one decision
        (8, [0.1] * 8, [0] * 8, 200, FleetLoad(2.0, 2.0, 0.5), 4),
        # KV usage still counts: 0.9 / 0.6 of 2
        (2, [0.9, 0.9], [0, 0], 4, FleetLoad(1.0, 1.0, 0.1), 3),
        # nothing finished yet: queue depth and ongoing requests stand in (12 / 4 = 3)
        (1, [0.1], [12], 12, FleetLoad(5.0, 0.0, 1.0), 3),
    ],
)
def test_policy_sizes_the_fleet_for_the_work_the_arrivals_bring(
    replicas, kv_usage, waiting, ongoing, load, desired
):
    policy = KVPressurePolicy(target_utilization=0.5, backlog_drain_s=30)
    assert policy.desired_replicas(replicas, kv_usage, waiting, ongoing, load) == desired


def test_policy_reads_what_the_replicas_report_to_serve():
    """Serve's AutoscalingContext, as Serve 2.60 fills it: per metric, each replica's window mean."""
    from ray.serve.config import AutoscalingContext

    from common.autoscaling_stats import ARRIVALS, FINISHED, KV_USAGE, WAITING, WORK

    per_replica = {KV_USAGE: 0.1, WAITING: 0.0, ARRIVALS: 2.0, FINISHED: 2.0, WORK: 0.5}
    metrics = {name: {"a": value, "b": value} for name, value in per_replica.items()}
    ctx = AutoscalingContext(
        deployment_id=None, deployment_name="EngineReplica", app_name="app", current_num_replicas=2,
        target_num_replicas=2, running_replicas=[], total_num_requests=100, total_queued_requests=15,
        aggregated_metrics=metrics, raw_metrics=None, capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8, policy_state={}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=None, config=None,
    )  # fmt: skip
    # 4 requests/s and 15 queued at the routers (0.5/s more to drain them in 30 s), at 0.25 s of
    # step work each: 1.125 replicas' worth, at half of each: 3
    assert KVPressurePolicy(target_utilization=0.5, backlog_drain_s=30)(ctx)[0] == 3


def test_policy_targets_are_checked():
    with pytest.raises(ValueError, match="target_kv_cache_usage"):
        KVPressurePolicy(target_kv_cache_usage=1.5)
    with pytest.raises(ValueError, match="target_waiting_requests"):
        KVPressurePolicy(target_waiting_requests=0)
    with pytest.raises(ValueError, match="target_ongoing_requests"):
        KVPressurePolicy(target_ongoing_requests=0)
    with pytest.raises(ValueError, match="max_downscale_fraction"):
        KVPressurePolicy(max_downscale_fraction=0)
    with pytest.raises(ValueError, match="target_utilization"):
        KVPressurePolicy(target_utilization=0)
    with pytest.raises(ValueError, match="backlog_drain_s"):
        KVPressurePolicy(backlog_drain_s=-1)


def test_a_new_report_refreshes_serves_cached_queue_length_of_its_replica():
    # Serve probes a replica whose cached queue length is stale before sending to it, and skips it
    # when the probe is late; a replica that reports needs no probe. Serve counts calls: one
    # request of 4 choices is one, though the engine holds 4 requests.
    router = KVPressureRouter(DeploymentID("EngineReplica", "app"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(sink=PrometheusSink(prometheus_client.CollectorRegistry()))
    one_call = replace(report(free=50), num_waiting=3, num_running=1, num_ongoing_requests=1)
    replica = SimpleNamespace(replica_id="a", routing_stats=one_call.to_report())
    assert router.replica_queue_len_cache.get("a") is None
    router.observe_reports([replica])
    assert router.replica_queue_len_cache.get("a") == 1
    router.replica_queue_len_cache.update("a", 9)  # Serve's own (an acceptance) since
    router.observe_reports([replica])  # the same report again: not new, no refresh
    assert router.replica_queue_len_cache.get("a") == 9
    replica.routing_stats = replace(one_call, report_seq=1, num_ongoing_requests=0).to_report()
    router.observe_reports([replica])
    assert router.replica_queue_len_cache.get("a") == 0
