"""Engine metrics through the prometheus_client sink, with the real model: the counts must add up."""

from __future__ import annotations

import math

import prometheus_client
import pytest

from common.autoscaling_stats import ARRIVALS, FINISHED, WORK, LoadMeter
from replica_engine import EngineConfig, LLMEngine, SamplingParams
from replica_engine.metrics import EngineMetrics, PrometheusSink
from replica_engine.scheduler.plan import StepSummary
from replica_engine.scheduler.step_time_model import StepShape
from replica_engine.step_listeners import StepLoad

LABELS = {"model_name": "smollm2"}


def run_engine(engine_settings: dict, prompts: list[str], max_tokens: int) -> tuple[LLMEngine, object]:
    registry = prometheus_client.CollectorRegistry()
    engine = LLMEngine(EngineConfig(**engine_settings), EngineMetrics(PrometheusSink(registry), "smollm2"))
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine, registry


def sample(registry, name: str, labels: dict[str, str] | None = None) -> float:
    value = registry.get_sample_value(name, labels if labels is not None else LABELS)
    assert value is not None, f"{name} {labels} was never recorded"
    return value


PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "A poem about the sea:"]


def test_counters_start_at_zero_before_anything_is_counted():
    registry = prometheus_client.CollectorRegistry()
    EngineMetrics(PrometheusSink(registry), "smollm2")
    assert sample(registry, "stallfree_num_preemptions_total") == 0
    for reason in ("stop", "length", "abort", "error"):
        assert (
            sample(registry, "stallfree_requests_finished_total", {**LABELS, "finished_reason": reason}) == 0
        )


def test_initializing_the_series_again_keeps_every_count():
    """The replica re-sends the zero-at-start series now and then (Ray loses a first export's 0)."""
    registry = prometheus_client.CollectorRegistry()
    metrics = EngineMetrics(PrometheusSink(registry), "smollm2")
    metrics.generation_tokens.inc(3, LABELS)
    metrics.initialize_series()
    assert sample(registry, "stallfree_generation_tokens_total") == 3
    assert sample(registry, "stallfree_num_preemptions_total") == 0


def test_counts_add_up_after_a_run():
    engine, registry = run_engine({}, PROMPTS, max_tokens=6)
    num_requests, num_tokens = len(PROMPTS), len(PROMPTS) * 6
    assert sample(registry, "stallfree_time_to_first_token_seconds_count") == num_requests
    assert sample(registry, "stallfree_inter_token_latency_seconds_count") == num_tokens - num_requests
    assert sample(registry, "stallfree_e2e_request_latency_seconds_count") == num_requests
    assert sample(registry, "stallfree_request_queue_time_seconds_count") == num_requests
    assert sample(registry, "stallfree_generation_tokens_total") == num_tokens
    prompt_tokens = sum(len(engine.tokenize(p)) for p in PROMPTS)
    assert sample(registry, "stallfree_prompt_tokens_total") == prompt_tokens
    assert sample(registry, "stallfree_request_prompt_tokens_sum") == prompt_tokens
    assert sample(registry, "stallfree_request_generation_tokens_sum") == num_tokens
    assert sample(registry, "stallfree_requests_finished_total", {**LABELS, "finished_reason": "length"}) == 4
    # Every scheduled token shows up in exactly one step.
    assert sample(registry, "stallfree_iteration_tokens_sum") == prompt_tokens + num_tokens - num_requests
    num_steps = sample(registry, "stallfree_iteration_tokens_count")
    assert sample(registry, "stallfree_step_duration_seconds_count") == num_steps
    # The share of each step outside the model: a fraction, every step.
    assert sample(registry, "stallfree_step_overhead_fraction_count") == num_steps
    assert 0 < sample(registry, "stallfree_step_overhead_fraction_sum") < num_steps
    # All finished: the gauges say so.
    assert sample(registry, "stallfree_kv_cache_usage_perc") == 0
    assert sample(registry, "stallfree_num_requests_running") == 0
    assert sample(registry, "stallfree_num_requests_waiting") == 0
    assert sample(registry, "stallfree_num_free_kv_blocks") == engine.core.kv_cache_manager.num_blocks


def test_preemptions_and_aborts_are_counted():
    # 12 blocks of 16 tokens cannot hold four requests of ~60 tokens each: some are preempted.
    engine, registry = run_engine({"num_kv_blocks": 12}, PROMPTS * 2, max_tokens=48)
    assert engine.core.scheduler.num_preemptions > 0
    assert sample(registry, "stallfree_num_preemptions_total") == engine.core.scheduler.num_preemptions

    request_id = engine.add_request("Tell me a story", SamplingParams(max_tokens=50))
    assert sample(registry, "stallfree_num_requests_waiting") == 1  # queue depth moves on arrival
    engine.step()
    assert sample(registry, "stallfree_kv_cache_usage_perc") > 0
    engine.abort_request(request_id)
    assert sample(registry, "stallfree_requests_finished_total", {**LABELS, "finished_reason": "abort"}) == 1
    assert sample(registry, "stallfree_kv_cache_usage_perc") == 0


@pytest.mark.parametrize(
    "name", ["stallfree_time_to_first_token_seconds", "stallfree_e2e_request_latency_seconds"]
)
def test_latency_buckets_mark_the_slo_lines(name: str):
    _, registry = run_engine({"kv_cache_bytes": 16 << 20}, PROMPTS[:1], max_tokens=2)
    for bound in ("0.1", "0.25", "0.5", "1.0", "2.0", "5.0"):
        assert registry.get_sample_value(f"{name}_bucket", {**LABELS, "le": bound}) is not None
    for bound in ("0.005", "0.01", "0.025", "0.05", "0.1", "0.2", "0.5"):
        labels = {**LABELS, "le": bound}
        assert registry.get_sample_value("stallfree_inter_token_latency_seconds_bucket", labels) is not None


def test_an_engine_core_in_its_own_process_records_into_this_process_metrics():
    """AsyncEngine's core runs in another process (core_process): its metric updates travel with
    its outputs and are replayed here, by the time the stream ends."""
    import asyncio

    from replica_engine import AsyncEngine

    registry = prometheus_client.CollectorRegistry()
    config = EngineConfig(dtype="float32", core_process=True)
    engine = AsyncEngine(config, EngineMetrics(PrometheusSink(registry), "smollm2"))

    async def run() -> None:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        for prompt in PROMPTS[:2]:
            async for _ in await engine.add_request(prompt, params):
                pass

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert sample(registry, "stallfree_generation_tokens_total") == 10
    finished = {**LABELS, "finished_reason": "length"}
    assert sample(registry, "stallfree_requests_finished_total", finished) == 2
    assert sample(registry, "stallfree_time_to_first_token_seconds_count") == 2
    assert sample(registry, "stallfree_inter_token_latency_seconds_count") == 8
    assert sample(registry, "stallfree_iteration_tokens_count") >= 5  # a step listener's, too
    assert sample(registry, "stallfree_num_requests_running") == 0  # the gauges after the last step


def test_a_buffered_sink_carries_every_count_and_observation_and_each_gauges_latest_value():
    """What a core in its own process records, replayed in the frontend: the same figures as
    recorded there directly, with one gauge update per gauge and label set per drain."""
    from common.metrics_sinks import BufferedSink

    buffered = BufferedSink()
    core_side = EngineMetrics(buffered, "smollm2")
    for running, latency in ((3, 0.01), (5, 0.02), (2, 0.03)):
        core_side.num_requests_running.set(running, core_side.labels)
        core_side.inter_token_latency.observe(latency, core_side.labels)
        core_side.preemptions.inc(1, core_side.labels)
    ops = buffered.drain()
    assert [op[1] for op in ops].count("set") == 1 and buffered.drain() == []
    registry = prometheus_client.CollectorRegistry()
    EngineMetrics(PrometheusSink(registry), "smollm2").replay(ops)
    assert sample(registry, "stallfree_num_requests_running") == 2
    assert sample(registry, "stallfree_inter_token_latency_seconds_count") == 3
    assert sample(registry, "stallfree_inter_token_latency_seconds_sum") == pytest.approx(0.06)
    assert sample(registry, "stallfree_num_preemptions_total") == 3


def test_stats_count_requests_and_step_work_for_the_autoscaler():
    """The running totals a replica turns into rates for its autoscaling report (LoadMeter)."""
    engine, _ = run_engine({}, PROMPTS, max_tokens=6)
    # Then a long prompt's step, slower than the fastest decode step before it however loaded the
    # host (the decodes' times alone may each fall below the last: no step beyond the fastest).
    engine.add_request(" ".join(["word"] * 300), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    request_id = engine.add_request("Aborted before it ran", SamplingParams(max_tokens=4))
    engine.abort_request(request_id)  # an abort finishes it too
    engine.abort_request("never-added")  # not in flight: nothing counted
    stats = engine.stats()
    num_requests = len(PROMPTS) + 2
    assert (stats.num_requests_added, stats.num_requests_finished) == (num_requests, num_requests)
    load = engine.core.step_load
    # Every step beyond the fastest counted, the fastest itself not: work is less than all steps.
    assert 0 < stats.step_work_s == pytest.approx(load.work_s)
    assert load.fastest_step_s > 0


def test_step_work_leaves_out_the_fixed_cost_of_a_step():
    load = StepLoad()
    for seconds in (0.05, 0.02, 0.02, 0.08):
        load(StepSummary(StepShape.of([]), 0, seconds))
    assert load.fastest_step_s == 0.02
    assert load.work_s == pytest.approx(0.0 + 0.0 + 0.0 + 0.06)  # the first step was the fastest then


def test_the_load_meter_turns_running_totals_into_rates_since_the_last_report():
    meter = LoadMeter()
    assert meter.rates(10.0, 4, 2, 1.0) == {}  # nothing to compare with yet
    rates = meter.rates(12.0, 10, 6, 2.0)
    assert rates == {ARRIVALS: 3.0, FINISHED: 2.0, WORK: 0.5}
    assert meter.rates(12.0, 10, 6, 2.0) == {}  # no time has passed


@pytest.mark.parametrize("every_s", [0.0, math.inf])
def test_the_gauges_are_recorded_at_most_every_gauges_every_s_and_once_idle(every_s):
    """A served core records its gauges (Ray's cost: ~0.1 ms each) at most every `gauges_every_s`
    while requests run, and always once it is idle, so the last value a scrape sees is true."""
    registry = prometheus_client.CollectorRegistry()
    engine = LLMEngine(EngineConfig(dtype="float32"), EngineMetrics(PrometheusSink(registry), "smollm2"))
    engine.core.gauges_every_s = every_s
    recorded = []
    record_stats = engine.core.metrics.record_stats
    engine.core.metrics.record_stats = lambda stats: (recorded.append(stats.num_running), record_stats(stats))
    for prompt in PROMPTS[:2]:
        engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    if every_s == 0:
        assert len(recorded) >= steps  # every step, and every request added
    else:
        assert len(recorded) <= 2, recorded  # the first add (nothing recorded before), then idle
    assert recorded[-1] == 0 and sample(registry, "stallfree_num_requests_running") == 0
