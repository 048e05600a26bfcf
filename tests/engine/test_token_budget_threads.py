"""Same TBT target, different hardware: the real SmolLM2 (dtype auto) on 2 torch threads and on
1. A fixed budget chosen so its prompt-chunk steps meet the target on 2 threads takes longer than
the target on 1; the adaptive budget (tbt_slo_s), fitted on each replica at start, holds it on
both. The target is set from this machine's own 2-thread step, so the test holds on any CPU
where 1 thread is more than 10% slower than 2 (it is skipped where that is not so)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from bench.workload import percentile as percentile_of
from bench.workload import random_tokens
from replica_engine import EngineConfig, SamplingParams
from replica_engine.engine import LLMEngine
from replica_engine.scheduler.plan import StepSummary

FIXED_BUDGET = 256


def chunk_steps(config: EngineConfig, threads: int) -> list[float]:
    """Durations of the steps that carried a prompt chunk, while four requests were decoding."""
    torch.set_num_threads(threads)
    engine = LLMEngine(config)
    steps: list[StepSummary] = []
    rng = random.Random(0)
    warm_up = random_tokens(rng, 600)  # first passes at each shape are slow
    engine.add_request(warm_up, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.step_listeners.append(steps.append)
    for _ in range(4):
        engine.add_request(random_tokens(rng, 24), SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(2):  # long prompts arriving while they decode
        engine.add_request(random_tokens(rng, 900), SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.kv_cache_manager.num_free_blocks == engine.core.kv_cache_manager.num_blocks
    return [s.duration_s for s in steps if s.num_prefill_tokens >= 32 and s.num_decode_requests]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_the_adaptive_budget_holds_a_target_on_1_and_2_threads_where_a_fixed_one_does_not(restore_threads):
    fixed = EngineConfig(max_num_batched_tokens=FIXED_BUDGET, enable_prefix_caching=False)
    fixed_2 = chunk_steps(fixed, threads=2)
    target = 1.1 * percentile_of(fixed_2, 0.5)  # the fixed budget meets it on 2 threads (median)
    fixed_1 = chunk_steps(fixed, threads=1)
    if percentile_of(fixed_1, 0.5) <= target:  # the premise: the same budget misses it on 1 thread
        median = percentile_of(fixed_1, 0.5)
        pytest.skip(f"1 thread is not slower than 2 here: p50 {median:.3f} s, target {target:.3f} s")

    adaptive = EngineConfig(max_num_batched_tokens=1024, tbt_slo_s=target, enable_prefix_caching=False)
    for threads in (1, 2):
        steps = chunk_steps(adaptive, threads)
        assert steps, "no step carried a prompt chunk of 32 tokens or more"
        # medians, as the premise: a dozen chunk steps on a host shared with the session's Ray
        # cluster have a tail of noise (the benchmark measures P99 TBT over thousands)
        assert percentile_of(steps, 0.5) <= target, (threads, target, sorted(steps))
