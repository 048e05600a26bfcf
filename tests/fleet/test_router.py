"""The router's ranking and the autoscaling policy's arithmetic, on made-up replica reports
(pure functions: no Ray needed)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import prometheus_client
import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest

from common.messages import GenerateRequest
from common.metrics_sinks import PrometheusSink
from common.sampling_params import SamplingParams
from router.autoscaling import KVPressurePolicy
from router.kv_router import KVPressureRouter
from router.pressure import (
    BY_KV,
    BY_QUEUE,
    MAX_IN_FLIGHT_S,
    NO_STATS,
    REPORT_LAG_S,
    PressureTracker,
    ReplicaLoad,
)

NOW = 1000.0


def report(free: int, total: int = 100, waiting_tokens: int = 0, seq: int = 0, block_size: int = 16) -> dict:
    return {
        "num_total_blocks": total,
        "num_free_blocks": free,
        "num_cached_free_blocks": 0,
        "num_waiting_prompt_tokens": waiting_tokens,
        "num_waiting": 0,
        "num_running": 1,
        "block_size": block_size,
        "report_seq": seq,
    }


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
        tracker.observe(replica, ReplicaLoad.parse(stats[replica]), now=NOW - 10)
    ranking = tracker.rank(
        ["none", "stale", "fresh", "old"], stats, {"stale": 5, "old": 2, "none": 0}, now=NOW
    )
    assert ranking == [("fresh", BY_KV), ("none", NO_STATS), ("old", BY_QUEUE), ("stale", BY_QUEUE)]


def test_a_report_is_dated_by_its_arrival_on_the_routers_clock():
    # No replica clock is read: a report is fresh from when this router first saw its number,
    # however far the replica's own clock is from this router's.
    tracker = PressureTracker()
    tracker.observe("a", ReplicaLoad.parse(report(free=50, seq=7)), now=NOW)
    assert tracker.reason("a", ReplicaLoad.parse(report(free=50, seq=7)), now=NOW + 1.9) == BY_KV
    assert tracker.reason("a", ReplicaLoad.parse(report(free=50, seq=7)), now=NOW + 2.1) == BY_QUEUE
    assert tracker.reason("a", ReplicaLoad.parse(report(free=48, seq=8)), now=NOW + 2.2) == BY_KV  # a new one
    tracker.keep_only(["b"])  # a is gone: its report is forgotten
    assert tracker.reason("a", ReplicaLoad.parse(report(free=48, seq=8)), now=NOW + 9) == BY_KV


def test_malformed_stats_count_as_missing():
    assert ReplicaLoad.parse({"num_free_blocks": 3}) is None
    assert ReplicaLoad.parse(None) is None
    assert PressureTracker().rank(["x"], {"x": {"bogus": 1}}, {}, now=NOW) == [("x", NO_STATS)]


def test_in_flight_requests_correct_the_last_report_until_a_newer_one_counts_them():
    tracker = PressureTracker()
    stats = {"a": report(free=50), "b": report(free=45)}
    assert tracker.rank(["a", "b"], stats, {}, now=NOW)[0][0] == "a"
    tracker.on_sent("r1", "a", num_tokens=16 * 10, now=NOW + 0.1)  # 10 blocks: a is at 60 used
    assert tracker.rank(["a", "b"], stats, {}, now=NOW + 0.2)[0][0] == "b"
    # a's next report, arriving after r1 was sent, already holds r1: it is not counted twice.
    stats["a"] = report(free=40, seq=1)
    assert tracker.pressure("a", ReplicaLoad.parse(stats["a"]), now=NOW + 0.5) == pytest.approx(0.6)
    # A request sent after that report counts until it finishes.
    tracker.on_sent("r2", "a", num_tokens=16 * 20, now=NOW + 0.6)
    assert tracker.pressure("a", ReplicaLoad.parse(stats["a"]), now=NOW + 0.7) == pytest.approx(0.8)
    tracker.on_finished("r2", now=NOW + 0.75)
    assert tracker.pressure("a", ReplicaLoad.parse(stats["a"]), now=NOW + 0.8) == pytest.approx(0.6)


def test_a_request_finished_after_the_last_report_frees_its_blocks_until_a_report_shows_it():
    # A conversation's next turn comes the moment the last one ends: the last report still shows
    # the finished turn's blocks in use, and the router must not see that replica as loaded.
    tracker = PressureTracker()
    tracker.observe("a", ReplicaLoad.parse(report(free=90, seq=0)), now=NOW)
    tracker.on_sent("turn-1", "a", num_tokens=16 * 30, now=NOW + 0.1)
    busy = ReplicaLoad.parse(report(free=60, seq=1))  # counts turn-1: 40 used
    assert tracker.pressure("a", busy, now=NOW + 0.5) == pytest.approx(0.4)
    tracker.on_finished("turn-1", now=NOW + 0.6)
    assert tracker.pressure("a", busy, now=NOW + 0.7) == pytest.approx(0.1)
    # a report taken too soon after (received within REPORT_LAG_S) may still hold them ...
    assert tracker.pressure("a", ReplicaLoad.parse(report(free=60, seq=2)), now=NOW + 1.0) == pytest.approx(
        0.1
    )
    # ... a later one does not, and the correction goes
    idle = ReplicaLoad.parse(report(free=90, seq=3))
    assert tracker.pressure("a", idle, now=NOW + 0.6 + REPORT_LAG_S + 0.1) == pytest.approx(0.1)


def test_the_router_counts_a_burst_on_the_replicas_it_ranks_first_before_any_acceptance():
    # Serve ranks a burst's requests concurrently and reports acceptances later: each choice must
    # see the ones before it, though b's report says it holds one block more than a.
    router = KVPressureRouter(DeploymentID("EngineReplica", "app"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(sink=PrometheusSink(prometheus_client.CollectorRegistry()))
    # Stand-ins for Serve's RunningReplica: the router reads only these two attributes.
    replicas = [
        SimpleNamespace(replica_id="a", routing_stats=report(free=24, total=24)),
        SimpleNamespace(replica_id="b", routing_stats=report(free=23, total=24)),
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


def test_a_newer_report_counts_the_sends_before_it_and_unfinished_ones_are_forgotten_in_time():
    tracker = PressureTracker()
    tracker.observe("a", ReplicaLoad.parse(report(free=50, seq=0)), now=NOW)
    tracker.on_sent("cancelled-before-accepted", "a", num_tokens=16 * 10, now=NOW + 0.1)
    tracker.on_sent("to-b", "b", num_tokens=16, now=NOW + 0.1)
    tracker.observe("a", ReplicaLoad.parse(report(free=50, seq=1)), now=NOW + 0.5)
    assert tracker.in_flight_tokens("a") == 0
    assert tracker.in_flight_tokens("b") == 16
    # never reported finished: dropped once older than MAX_IN_FLIGHT_S (no leak)
    tracker.observe("a", ReplicaLoad.parse(report(free=50, seq=2)), now=NOW + MAX_IN_FLIGHT_S + 1)
    assert "cancelled-before-accepted" not in tracker._sent


def test_equal_pressure_ties_go_to_the_shorter_queue():
    stats = {"a": report(free=50), "b": report(free=50)}
    assert PressureTracker().rank(["a", "b"], stats, {"a": 3, "b": 1}, now=NOW)[0] == ("b", BY_KV)


def test_requests_count_their_prompt_and_output_tokens():
    params = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=20)]
    request = GenerateRequest("r", [[1] * 100, [1, 2, 3]], params, n=2)
    assert request.requested_tokens() == 2 * ((100 + 10) + (3 + 20))


@pytest.mark.parametrize(
    ("replicas", "kv_usage", "waiting", "desired"),
    [
        (1, [0.9], [0], 2),  # 0.9 / 0.6 = 1.5 -> 2
        (2, [0.3, 0.3], [0, 0], 1),  # half the target: half the replicas
        (2, [0.6, 0.6], [0, 0], 2),  # on target: stay
        (1, [0.1], [12], 3),  # the queue says more than KV: 12 / 4 = 3
        (3, [0.0, 0.0, 0.0], [0, 0, 0], 0),  # idle: Serve's min_replicas bounds this
        (2, [], [], 2),  # no reports yet: no change
    ],
)
def test_policy_scales_replicas_by_the_worse_of_kv_usage_and_queue_depth(
    replicas, kv_usage, waiting, desired
):
    policy = KVPressurePolicy(target_kv_cache_usage=0.6, target_waiting_requests=4)
    assert policy.desired_replicas(replicas, kv_usage, waiting) == desired


def test_policy_targets_are_checked():
    with pytest.raises(ValueError, match="target_kv_cache_usage"):
        KVPressurePolicy(target_kv_cache_usage=1.5)
    with pytest.raises(ValueError, match="target_waiting_requests"):
        KVPressurePolicy(target_waiting_requests=0)
