"""A simulated prefill/decode fleet (fleet_sim/disaggregated.py): every request is prefilled on a
prefill replica, its full blocks adopted by a decode replica (which finds them in its prefix
cache), and its TTFT carries the transfer: exactly the link's latency, the bytes over its rate
and the hop; transfers from one prefill replica queue on its link."""

from __future__ import annotations

import pytest

from fleet_sim.disaggregated import DisaggregatedConfig, DisaggregatedFleet, KvLink
from fleet_sim.records import summarize_records
from fleet_sim.replica import ReplicaConfig
from fleet_sim.routers import make_router
from fleet_sim.trace import SimRequest
from tests.sim.test_fleet import STEP_TIME, tenants_workload

REPLICA = ReplicaConfig(num_kv_blocks=256)
KV_BYTES_PER_TOKEN = 1000.0


def run(
    requests: list[SimRequest], link: KvLink, num_prefill: int = 1, num_decode: int = 1, hop_s: float = 0.0
):
    config = DisaggregatedConfig(num_prefill, num_decode, REPLICA, REPLICA, link, KV_BYTES_PER_TOKEN, hop_s)
    fleet = DisaggregatedFleet(
        config, STEP_TIME, STEP_TIME, make_router("kv_prefix", 0), make_router("kv_pressure", 0)
    )
    return fleet, fleet.run(requests)


def test_every_request_is_prefilled_elsewhere_and_its_blocks_adopted():
    requests = tenants_workload(seed=0, num_tenants=3, num_requests=40, rate=4.0)
    fleet, records = run(requests, KvLink("fast", 0.0, 1e12), num_prefill=2, num_decode=2)
    assert all(record.is_finished for record in records)
    for record in records:  # the decode replica computed only what the blocks did not hold
        assert record.num_cached_tokens == (len(record.request.prompt_token_ids) - 1) // 16 * 16
        assert record.replica_id.startswith("decode-")
    moved = sum(record.num_cached_tokens for record in records) * KV_BYTES_PER_TOKEN
    assert fleet.bytes_moved == pytest.approx(moved)
    assert summarize_records(records)["num_failed"] == 0


def test_a_transfer_adds_its_latency_bytes_over_the_rate_and_the_hop_to_the_ttft():
    (request,) = tenants_workload(seed=1, num_tenants=1, num_requests=1, rate=1.0)
    _, (fast,) = run([request], KvLink("fast", 0.0, 1e15))
    _, (slow,) = run([request], KvLink("slow", 0.003, 1e6), hop_s=0.002)
    num_bytes = (len(request.prompt_token_ids) - 1) // 16 * 16 * KV_BYTES_PER_TOKEN
    added = slow.timing().ttft_s - fast.timing().ttft_s
    assert added == pytest.approx(0.003 + num_bytes / 1e6 + 0.002, rel=1e-6)


def test_transfers_from_one_prefill_replica_queue_on_its_link():
    prompt = tuple(range(1, 330))  # each 20 full blocks: 320,000 bytes
    twins = [SimRequest(f"r{i}", 0.0, (*prompt[i:], i), 4) for i in range(2)]
    fleet, _ = run(twins, KvLink("slow", 0.0, 1e6), num_decode=2)
    (_, first_arrived), (second_exported, second_arrived) = sorted(fleet.transfers)
    assert second_exported < first_arrived  # the link was still busy: it waited for the first
    assert second_arrived == pytest.approx(first_arrived + 0.32, rel=1e-6)
