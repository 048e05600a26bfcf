"""The simulator's copy of Ray's PrefixCacheAffinityRouter (fleet_sim/ray_prefix_router.py) against
the real one: bench/serving/record_ray_router.py sent the fixture's prompts one by one through Ray Serve to 3
real replicas and noted the replica Ray's router chose for each, with the queue lengths in its cache
then. Replayed in order, the simulator must choose the same replica every time."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from fleet_sim.clock import EventLoop
from fleet_sim.ray_prefix_router import RayPrefixCacheAffinity
from fleet_sim.replica import ReplicaConfig, SimReplica
from fleet_sim.trace import SimRequest
from replica_engine.scheduler.step_time_model import StepTimeModel

RECORDING = json.loads((Path(__file__).parent / "data" / "ray_prefix_router_choices.json").read_text())
STEP_TIME = StepTimeModel()  # unfitted: nothing steps here


class NoDraws(random.Random):
    """Every recorded choice is Ray's by rule; a random draw (power of two) would pass by luck."""

    def shuffle(self, x: Any) -> None:
        raise AssertionError("the simulator fell back to a random draw")


def replay(router: RayPrefixCacheAffinity, queue_lens: bool = True) -> list[str]:
    loop = EventLoop()
    replicas = {
        name: SimReplica(name, ReplicaConfig(num_kv_blocks=16), STEP_TIME, loop, lambda *_: None)
        for name in RECORDING["candidate_order"]
    }
    # The tree takes the replicas in the order of the first call, Ray's tree in its own: an empty
    # tree matches nothing, so the first choice depends on that order alone.
    order = RECORDING["tenant_order"]
    chosen = []
    for i, step in enumerate(RECORDING["requests"]):
        for name, queue_len in step["queue_lens"].items():
            replicas[name].num_ongoing = queue_len if queue_lens else 0
        # The simulator's prompt text is one character per token id (prompt_text): the request whose
        # ids are a recorded text's code points is that text, character for character.
        request = SimRequest(f"r{i}", float(i), tuple(map(ord, step["text"])), max_tokens=1)
        replica = router.rank(request, [replicas[name] for name in order], float(i))[0]
        router.on_routed(request, replica, float(i))
        chosen.append(replica.replica_id)
        order = RECORDING["candidate_order"]  # Ray lists candidates in its replica set's order
    return chosen


def mismatches(chosen: list[str]) -> list[str]:
    return [
        f"request {i} ({step['note']}): Ray chose {step['chosen']}, the simulator {choice}"
        for i, (step, choice) in enumerate(zip(RECORDING["requests"], chosen, strict=True))
        if choice != step["chosen"]
    ]


def test_the_simulator_chooses_what_ray_chose_for_every_recorded_request():
    assert mismatches(replay(RayPrefixCacheAffinity(NoDraws()))) == []


def smallest_is_everyone(router: RayPrefixCacheAffinity) -> None:
    router.tree.get_smallest_tenants = lambda: list(router.tree.tenant_to_char_count)


@pytest.mark.parametrize(
    ("match_rate_threshold", "change", "queue_lens"),
    [(0.05, None, True), (0.2, None, True), (0.1, smallest_is_everyone, True), (0.1, None, False)],
    ids=["threshold 5%", "threshold 20%", "below it, any replica", "queue lengths unseen"],
)
def test_the_recording_tells_a_changed_rule_apart(match_rate_threshold, change, queue_lens):
    router = RayPrefixCacheAffinity(random.Random(0), match_rate_threshold=match_rate_threshold)
    if change is not None:
        change(router)
    assert mismatches(replay(router, queue_lens)) != []
