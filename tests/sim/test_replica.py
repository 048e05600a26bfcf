"""A simulated replica: the engine's own scheduler and KV cache, only the forward pass replaced by
a step-time model."""

import random

import pytest

from common.sampling_params import SamplingParams
from fleet_sim.clock import EventLoop
from fleet_sim.fleet import Fleet, FleetConfig
from fleet_sim.replica import ReplicaConfig, SimReplica, engine_request, sim_core
from fleet_sim.routers import make_router
from fleet_sim.trace import SimRequest
from replica_engine import EngineConfig, LLMEngine
from replica_engine.scheduler.step_time_model import StepTimeModel

# 10 ms a step plus 1 ms per prompt token; decodes, attention and requests cost nothing more.
STEP_TIME = StepTimeModel.from_coefficients([0.010, 0.001, 0.0, 0.0, 0.0, 0.0])


def test_a_two_request_timeline_computed_by_hand():
    # A (32 prompt tokens, 3 out) at 0; B (16, 2) at 15 ms, while A's prompt step runs.
    # step 1, 0-42 ms: A's prompt (10 + 32) -> A's 1st token at 42 ms; B joins after it.
    # step 2, 42-68 ms: A's decode + B's prompt (10 + 16) -> A's 2nd and B's 1st at 68 ms.
    # step 3, 68-78 ms: both decode (10) -> A's 3rd and B's 2nd at 78 ms: both done.
    requests = [
        SimRequest("A", 0.0, tuple(range(1, 33)), max_tokens=3),
        SimRequest("B", 0.015, tuple(range(100, 116)), max_tokens=2),
    ]
    fleet = Fleet(FleetConfig(1, ReplicaConfig(num_kv_blocks=16)), STEP_TIME, make_router("round_robin", 0))
    a, b = fleet.run(requests)
    assert a.token_times == pytest.approx([0.042, 0.068, 0.078])
    assert b.token_times == pytest.approx([0.068, 0.078])
    assert b.timing().ttft_s == pytest.approx(0.053)


def test_a_two_stage_pipeline_timeline_computed_by_hand():
    # Two stages, each half a step's time; a 32-token budget holds one prompt a batch. A (32, 3
    # out) and B (16, 2) at 0. Stage 0 | stage 1, in ms:
    # batch 1 {A's prompt} (42 / 2 = 21 a stage): 0-21 | 21-42 -> A's 1st token at 42.
    # batch 2 {B's prompt} (26 / 2 = 13): 21-34 | 42-55 -> B's 1st at 55 (A sat out: in flight).
    # batch 3 {A} (5 a stage): 42-47 | 55-60 -> A's 2nd at 60; batch 4 {B}: 55-60 | 60-65 -> B's
    # 2nd at 65; batch 5 {A}: 60-65 | 65-70 -> A's 3rd at 70. One stage: A's at 42, 68, 78.
    requests = [
        SimRequest("A", 0.0, tuple(range(1, 33)), max_tokens=3),
        SimRequest("B", 0.0, tuple(range(100, 116)), max_tokens=2),
    ]
    config = ReplicaConfig(num_kv_blocks=16, max_num_batched_tokens=32, pipeline_parallel_size=2)
    fleet = Fleet(FleetConfig(1, config), STEP_TIME, make_router("round_robin", 0))
    a, b = fleet.run(requests)
    assert a.token_times == pytest.approx([0.042, 0.060, 0.070])
    assert b.token_times == pytest.approx([0.055, 0.065])


def test_a_request_that_can_never_fit_the_pool_is_refused_by_name():
    replica = SimReplica("r", ReplicaConfig(num_kv_blocks=2), STEP_TIME, EventLoop(), lambda *_: None)
    with pytest.raises(ValueError, match=r"'big'.*3 KV blocks.*has 2"):
        replica.submit(engine_request(SimRequest("big", 0.0, tuple(range(40)), max_tokens=1)))


def recorded_trace(seed: int) -> list[tuple[int, str, list[int], int]]:
    """(arrival step, id, prompt, max_tokens): three tenants' 48-token prefixes with suffixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 500) for _ in range(48)] for _ in range(3)]
    trace = []
    for i in range(14):
        suffix = [rng.randrange(1, 500) for _ in range(rng.randrange(5, 40))]
        trace.append((rng.randrange(0, 12), f"req-{i}", prefixes[i % 3] + suffix, rng.randrange(4, 20)))
    return sorted(trace, key=lambda entry: entry[0])


def test_the_simulated_replica_schedules_exactly_as_the_real_engine_step_for_step():
    """The real engine (a tiny Llama, random weights) and the simulated replica get the same
    requests at the same steps, with a pool small enough to preempt and a budget that chunks
    prompts: every step must run the same rows, and the same prompt tokens come from the cache."""
    settings = dict(num_kv_blocks=20, max_num_batched_tokens=32, max_num_seqs=6, block_size=16)
    engine = LLMEngine(EngineConfig(model="dummy:tiny-llama", dtype="float32", **settings))
    real_batches = []
    schedule = engine.core.scheduler.schedule
    engine.core.scheduler.schedule = lambda: real_batches.append(schedule()) or real_batches[-1]
    core = sim_core(ReplicaConfig(model="dummy:tiny-llama", **settings), STEP_TIME)
    sim_batches, step, trace = [], 0, recorded_trace(seed=3)
    sim_schedule = core.scheduler.schedule
    core.scheduler.schedule = lambda: sim_batches.append(sim_schedule()) or sim_batches[-1]
    real_cached, sim_cached = {}, {}
    while trace or engine.has_unfinished_requests() or core.has_unfinished_requests():
        while trace and trace[0][0] <= step:
            _, request_id, prompt, max_tokens = trace.pop(0)
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id)
            core.add_request(engine_request(SimRequest(request_id, float(step), tuple(prompt), max_tokens)))
        real_cached |= {out.request_id: out.num_cached_tokens for out in engine.step() if out.finished}
        sim_cached |= {out.request_id: out.num_cached_tokens for out in core.step() if out.finished}
        step += 1

    def rows(batches):
        return [[(r.request_id, r.start_position, r.num_tokens) for r in b.rows] for b in batches]

    assert rows(sim_batches) == rows(real_batches)
    assert [b.num_preempted for b in sim_batches] == [b.num_preempted for b in real_batches]
    assert engine.core.scheduler.num_preemptions == core.scheduler.num_preemptions > 0
    assert sim_cached == real_cached and len(real_cached) == 14
    assert sum(real_cached.values()) > 0  # prefix-cache hits happened, and the same ones
