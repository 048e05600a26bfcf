"""Autoscaling in the simulated fleet: Serve's delays and bounds around our policy or Serve's."""

import random

import pytest

from fleet_sim.autoscaling import AutoscalingSpec
from fleet_sim.fleet import Fleet, FleetConfig
from fleet_sim.replica import ReplicaConfig
from fleet_sim.routers import make_router
from fleet_sim.trace import SimRequest
from replica_engine.scheduler.step_time_model import StepTimeModel

STEP_TIME = StepTimeModel.from_coefficients([0.012, 0.0005, 0.00025, 1e-8, 1e-8, 0.0])
RAMP_AT_S = 60.0


def ramp(seed: int) -> list[SimRequest]:
    """1 request/s for a minute, then 8/s for a minute: 300-token prompts, 200 tokens out. A
    replica holds ~3 of the first (KV use ~0.3) and falls behind on the second."""
    rng, requests, now = random.Random(seed), [], 0.0
    while now < 2 * RAMP_AT_S:
        now += rng.expovariate(1.0 if now < RAMP_AT_S else 8.0)
        prompt = tuple(rng.randrange(1, 32000) for _ in range(300))
        requests.append(SimRequest(f"r{len(requests)}", now, prompt, max_tokens=200))
    return requests


def run_ramp(policy: str) -> Fleet:
    spec = AutoscalingSpec(
        policy=policy, min_replicas=1, max_replicas=4, upscale_delay_s=5.0, downscale_delay_s=20.0,
        look_back_period_s=15.0, target_ongoing_requests=8.0,
    )  # fmt: skip
    config = FleetConfig(1, ReplicaConfig(num_kv_blocks=256), replica_start_s=10.0, autoscaling=spec)
    fleet = Fleet(config, STEP_TIME, make_router("kv_pressure", 0))
    records = fleet.run(ramp(seed=0))
    assert all(record.is_finished for record in records)
    return fleet


@pytest.mark.parametrize("policy", ["kv_pressure", "ongoing_requests"])
def test_a_ramp_scales_up_only_after_the_delay_and_the_start_time(policy):
    fleet = run_ramp(policy)
    first_up = next(t for t, n in fleet.timeline if n > 1)
    assert first_up >= RAMP_AT_S + 5.0 + 10.0  # the ramp, Serve's upscale delay, the replica's start
    assert max(n for _, n in fleet.timeline) <= 4
    served = {r.replica_id for r in fleet.records.values()}
    assert len(served) > 1
    end = max(r.token_times[-1] for r in fleet.records.values())
    assert fleet.replica_seconds < 4 * end


def test_a_run_with_autoscaling_repeats_exactly():
    first, second = run_ramp("kv_pressure"), run_ramp("kv_pressure")
    assert first.timeline == second.timeline and first.replica_seconds == second.replica_seconds


def test_bad_bounds_and_policies_are_refused_by_name():
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalingSpec(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="policy"):
        AutoscalingSpec(policy="cpu")
