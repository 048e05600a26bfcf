"""Same TBT target, different hardware: the real SmolLM2 (dtype auto) on 2 torch threads and on
1. The target is set below the median prompt-chunk step of a fixed 256-token budget on 1 thread
(0.8x it), so by construction that fixed budget misses it there; the adaptive budget (tbt_slo_s),
fitted on each replica at start, holds it on 1 thread and on 2 (where steps are faster, so a
budget fitted on 1 thread would waste them). Nothing depends on how much faster 2 threads are
on this host, so the test has no premise to skip on."""

from __future__ import annotations

import os
import random
from statistics import median

import pytest
import torch

from harness.random_workload import random_tokens
from replica_engine import EngineConfig, SamplingParams
from replica_engine.engine import LLMEngine
from replica_engine.scheduler.plan import StepSummary

FIXED_BUDGET = 256
TARGET_OF_FIXED_1_THREAD = 0.8  # the target, as a fraction of the fixed budget's 1-thread median


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
def test_the_adaptive_budget_holds_on_1_and_2_threads_a_target_a_fixed_budget_misses_on_1(restore_threads):
    fixed = EngineConfig(max_num_batched_tokens=FIXED_BUDGET, enable_prefix_caching=False)
    target = TARGET_OF_FIXED_1_THREAD * median(chunk_steps(fixed, threads=1))

    adaptive = EngineConfig(max_num_batched_tokens=1024, tbt_slo_s=target, enable_prefix_caching=False)
    for threads in (1, 2):
        steps = chunk_steps(adaptive, threads)
        assert steps, f"no step carried a prompt chunk of 32 tokens or more on {threads} thread(s)"
        # medians: a dozen chunk steps on a host shared with the session's Ray cluster have a
        # tail of noise (bench.capacity measures P99 TBT over thousands)
        assert median(steps) <= target, (threads, target, sorted(steps))
