"""The step-time model and the token budget it sets from a TBT target (no model: the scheduler is
driven by tests/engine/scheduler_harness.py, step times are synthetic)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import InvalidRequestError
from replica_engine import EngineConfig, step_profile
from replica_engine.kv_cache_manager import KVCacheManager
from replica_engine.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from replica_engine.scheduler.plan import ScheduledBatch
from replica_engine.scheduler.step_time_model import ExpertRouting, StepShape, StepTimeModel, profile_shapes
from replica_engine.scheduler.token_budget import MIN_PREFILL_CHUNK, SLOTokenBudget
from tests.engine.scheduler_harness import StepArrival, make_scheduler, run_to_completion

# A CPU-like step: 15 ms over the weights, 0.4 ms a prompt token, 0.5 ms a decode, attention 0.1 µs
# a prompt chunk's query-key pair and 0.3 µs a decode's, 0.8 ms a request.
TRUE = np.array([0.015, 0.0004, 0.0005, 1e-7, 3e-7, 0.0008])


def true_time(shape: StepShape) -> float:
    return float(shape.features() @ TRUE)


def random_shape(rng: random.Random) -> StepShape:
    shape = StepShape()
    for _ in range(rng.randint(0, 16)):
        shape = shape.plus(rng.randint(16, 4096), 1, is_decode=True)  # contexts wide enough to tell
    for _ in range(rng.randint(0, 6)):  # prompt chunks, as many as decodes can be, so the two separate
        shape = shape.plus(rng.randint(0, 512), rng.randint(2, 256))
    return shape if shape.num_requests else shape.plus(0, 64)


def perfect_model() -> StepTimeModel:
    model = StepTimeModel(quantile=1.0)
    rng = random.Random(0)
    model.fit_profile((shape, true_time(shape)) for shape in (random_shape(rng) for _ in range(64)))
    return model


def test_the_fit_recovers_known_coefficients_from_noisy_steps():
    rng = random.Random(1)
    model = StepTimeModel()
    shapes = [random_shape(rng) for _ in range(1000)]
    model.fit_profile((shape, true_time(shape) * rng.uniform(0.99, 1.01)) for shape in shapes)
    np.testing.assert_allclose(model.coefficients, TRUE, rtol=0.15)
    # calibrated at the 95th percentile: most steps take at most the prediction
    within = [true_time(s) * rng.uniform(0.99, 1.01) <= model.predict(s) for s in shapes]
    assert 0.85 <= sum(within) / len(within) <= 1.0


def test_a_mixture_of_experts_fits_the_experts_its_steps_read_apart_from_the_tokens():
    """Steps whose time grows with the distinct experts their tokens pick (64 of 128 ... all
    of them), not linearly in the tokens: the expert feature's coefficient is recovered, routers
    are sent the six shape coefficients, and a model without the feature predicts worse."""
    routing = ExpertRouting(num_experts=128, top_k=8)
    per_expert = 2e-4  # seconds to read one expert in every layer

    def moe_time(shape: StepShape) -> float:
        return true_time(shape) + per_expert * routing.expected_touched(
            shape.num_prefill_tokens + shape.num_decodes
        )

    rng = random.Random(3)
    shapes = [random_shape(rng) for _ in range(500)]
    samples = [(shape, moe_time(shape) * rng.uniform(0.99, 1.01)) for shape in shapes]
    model, plain = StepTimeModel(experts=routing), StepTimeModel()
    model.fit_profile(samples)
    plain.fit_profile(samples)
    assert model.coefficients[6] == pytest.approx(per_expert, rel=0.15)
    assert model.shape_coefficients == tuple(model.coefficients[:6])
    assert routing.expected_touched(1) == pytest.approx(8) and routing.expected_touched(
        1000
    ) == pytest.approx(128)

    def error(m: StepTimeModel) -> float:
        return max(abs(m.predict_raw(s) / moe_time(s) - 1) for s in shapes)

    assert error(model) < 0.05 < error(plain)


def test_coefficients_stay_non_negative_so_more_work_never_predicts_less_time():
    rng = random.Random(2)
    model = StepTimeModel()
    # decode steps only, with per-request cost negatively correlated to noise: a plain fit may go negative
    shapes = [StepShape().plus(0, 64)] + [StepShape.of([(100, 1, True)] * b) for b in range(1, 9)]
    model.fit_profile((shape, 0.02 + rng.uniform(-0.004, 0.004)) for shape in shapes)
    assert (model.coefficients >= 0).all()


def test_measured_steps_refresh_the_model_when_the_machine_slows_down():
    model = perfect_model()
    shape = StepShape().plus(0, 256)
    before = model.predict(shape)
    rng = random.Random(3)
    for _ in range(model.refit_every * 16):  # the host now runs at half speed
        observed = random_shape(rng)
        model.observe(observed, 2 * true_time(observed))
    assert model.predict(shape) == pytest.approx(2 * before, rel=0.15)


def test_the_allowance_keeps_the_step_within_the_target():
    budget = SLOTokenBudget(perfect_model(), tbt_slo_s=0.1)
    decodes = StepShape.of([(512, 1, True)] * 8)
    allowed = budget.allowance(decodes, start=0, limit=2048)
    assert MIN_PREFILL_CHUNK < allowed < 2048
    assert true_time(decodes.plus(0, allowed)) <= budget.target_s < true_time(decodes.plus(0, allowed + 1))
    # later in a long prompt, attention costs more per token: a smaller chunk
    assert budget.allowance(decodes, start=4096, limit=2048) < allowed


def test_the_allowance_at_its_boundaries():
    budget = SLOTokenBudget(perfect_model(), tbt_slo_s=0.1)
    assert budget.allowance(StepShape(), start=0, limit=64) == 64  # the cap binds before the target
    many_decodes = StepShape.of([(1024, 1, True)] * 200)  # decodes alone are over the target
    assert true_time(many_decodes) > budget.target_s
    allowed, decision = budget.decide(many_decodes, start=0, limit=2048)
    assert allowed == MIN_PREFILL_CHUNK and decision.decodes_over_slo
    assert decision.token_budget == 200 + MIN_PREFILL_CHUNK
    assert budget.allowance(many_decodes.plus(0, MIN_PREFILL_CHUNK), start=0, limit=2048) == 0
    assert budget.allowance(many_decodes, start=0, limit=5) == 5  # the minimum never exceeds the cap
    allowed, decision = budget.decide(StepShape(), start=0, limit=2048)
    assert not decision.decodes_over_slo and decision.token_budget == allowed


@settings(max_examples=60, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(2, 700), min_size=1, max_size=12),
    max_tokens=st.lists(st.integers(1, 40), min_size=12, max_size=12),
    arrival_steps=st.lists(st.integers(0, 30), min_size=12, max_size=12),
    tbt_slo_s=st.floats(0.03, 0.4),
)
def test_with_a_perfect_model_only_decodes_and_the_minimum_chunk_exceed_the_target(
    prompt_lens, max_tokens, arrival_steps, tbt_slo_s
):
    budget = SLOTokenBudget(perfect_model(), tbt_slo_s)
    scheduler = SCHEDULING_POLICIES["stall_free"](
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16), KVCacheManager(400, 16), budget
    )
    arrivals = [StepArrival(s, p, m) for p, m, s in zip(prompt_lens, max_tokens, arrival_steps, strict=False)]
    run = run_to_completion(scheduler, arrivals)
    for batch in run.batches:
        # one-token rows (decodes, a prompt's last token) are never held back by the target
        chunks = sum(row.num_tokens for row in batch.rows if row.num_tokens > 1)
        if budget.model.predict(batch.shape()) > budget.target_s + 1e-12:
            # then only the minimum chunk that keeps prompts moving can have pushed it over
            assert chunks <= MIN_PREFILL_CHUNK, (batch.shape(), chunks)
            assert batch.budget_decision is not None
    assert all(request.is_finished for request in run.requests)


def chunk_steps(scheduler, speed: float) -> list[tuple[int, float]]:
    """(prompt tokens, time on a host `speed` times TRUE's) of each step carrying a prompt chunk,
    while four requests decode and two long prompts arrive (bench.engine.token_budget_threads' load)."""
    arrivals = [StepArrival(0, 24, 60)] * 4 + [StepArrival(2, 900, 2)] * 2
    run = run_to_completion(scheduler, arrivals)
    shapes = [batch.shape() for batch in run.batches]
    return [(s.num_prefill_tokens, true_time(s) / speed) for s in shapes if s.num_prefill_tokens > 1]


def test_a_slower_host_gets_smaller_chunks_and_every_step_stays_within_the_target():
    """tbt_slo_s on hardware of two speeds, as a replica meets it: the step-time model is fitted
    on the replica's own startup profile (step_profile's shapes), here timed by a host of known
    speed. The speed claim itself (real threads, real steps) is bench.engine.token_budget_threads'."""
    config = EngineConfig(max_num_batched_tokens=1024, max_model_len=2048, max_num_seqs=16, tbt_slo_s=0.06)
    chunks = {}
    shapes = [StepShape.of(rows) for rows in profile_shapes(1024, 2048, 16)]
    for name, speed in (("slow", 1.0), ("fast", 2.0)):
        model = StepTimeModel()
        model.fit_profile((s, true_time(s) / speed) for s in shapes)
        budget = SLOTokenBudget(model, config.tbt_slo_s)
        scheduler = SCHEDULING_POLICIES["stall_free"](
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs),
            KVCacheManager(400, 16),
            budget,
        )
        steps = chunk_steps(scheduler, speed)
        assert all(seconds <= config.tbt_slo_s for _, seconds in steps), (name, steps)
        chunks[name] = max(tokens for tokens, _ in steps)
    # one target, two hosts: the faster one's chunks are larger (a slow host's budget would waste it)
    assert MIN_PREFILL_CHUNK < chunks["slow"] < chunks["fast"], chunks
    # the baseline: a fixed 256-token budget's chunk steps go over the target on the slow host
    fixed = make_scheduler("stall_free", budget=256, max_seqs=16, num_blocks=400, block_size=16)
    assert max(seconds for _, seconds in chunk_steps(fixed, speed=1.0)) > config.tbt_slo_s


def test_the_target_is_checked_and_belongs_to_stall_free():
    with pytest.raises(InvalidRequestError, match="tbt_slo_s"):
        EngineConfig(tbt_slo_s=0)
    with pytest.raises(InvalidRequestError, match="tbt_slo_s"):
        EngineConfig(tbt_slo_s="fast")
    with pytest.raises(InvalidRequestError, match="tbt_slo_s"):
        EngineConfig(tbt_slo_s=float("nan"))
    with pytest.raises(InvalidRequestError, match="tbt_slo_s"):
        EngineConfig(tbt_slo_s=0.1, scheduling_policy="prefill_first")
    assert EngineConfig(tbt_slo_s=0.1).tbt_slo_s == 0.1


class ClockedRunner:
    """A runner whose every step advances a fake clock by the step's true time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.executed: list[StepShape] = []

    def execute(self, batch: ScheduledBatch) -> None:
        self.executed.append(batch.shape())
        self.now += true_time(batch.shape())

    def release(self, request_ids: list[str]) -> None:
        pass


def test_the_startup_profile_stops_a_contexts_chunks_past_the_reach(monkeypatch):
    """With a reach, a prompt chunk as long as one timed over it, no earlier in its sequence, is
    never run (its step would take longer still); every shorter chunk and every decode batch is."""
    runner = ClockedRunner()
    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: runner.now)
    config = EngineConfig(max_num_batched_tokens=2048, max_model_len=8192, max_num_seqs=64)
    reach_s = 0.2
    samples = step_profile.profile_step_times(runner, config, 64, reach_s=reach_s)  # type: ignore[arg-type]

    timed = [shape for shape, _ in samples]
    assert [seconds for _, seconds in samples] == pytest.approx([true_time(shape) for shape in timed])
    assert runner.executed == [shape for shape in timed for _ in range(2)]  # warmed, then timed
    everything = profile_shapes(2048, 8192, 64)
    skipped = [rows for rows in everything if StepShape.of(rows) not in timed]
    assert skipped and all(true_time(StepShape.of(rows)) > reach_s for rows in skipped)
    assert all(any(not decode for _, _, decode in rows) for rows in skipped)  # decode batches all run
    past_reach = [
        rows[0][0]
        for rows in everything
        if len(rows) == 1
        and not rows[0][2]
        and StepShape.of(rows) in timed
        and true_time(StepShape.of(rows)) > reach_s
    ]
    assert len(past_reach) == len(set(past_reach))  # a context's chunks stop at the first past it
    unlimited = step_profile.profile_step_times(ClockedRunner(), config, 64)  # type: ignore[arg-type]
    assert len(unlimited) == len(everything)
