"""One point of bench.engine.capacity: a fixed-seed Poisson workload replayed at a given rate against an
in-process AsyncEngine, and what Sarathi-Serve's capacity is judged by (P99 time between tokens,
median scheduling delay), read from the engine's own metrics."""

from __future__ import annotations

import asyncio
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bench.driver import Arrival, EngineClient, engine_as_served, greedy
from common.latency import percentile
from common.metrics_sinks import PREFIX
from harness.pacing import open_loop
from harness.random_workload import log_uniform, random_tokens

if TYPE_CHECKING:
    from replica_engine.scheduler.plan import StepSummary

PROMPT_RANGE = (64, 1024)  # log-uniform, as Sarathi's synthetic traces
OUTPUT_RANGE = (16, 128)  # uniform; ignore_eos, so each request decodes exactly this many
TBT = PREFIX + "inter_token_latency_seconds"
QUEUE_TIME = PREFIX + "request_queue_time_seconds"
BUDGET = PREFIX + "step_token_budget"


def workload(num_requests: int, seed: int) -> list[Arrival]:
    """Random-token prompts (nothing shared: prefix caching is off anyway), exponential gaps at
    rate 1 req/s (replayed at rate r, each arrives at at_s / r)."""
    rng = random.Random(seed)
    arrivals, clock = [], 0.0
    for _ in range(num_requests):
        prompt = random_tokens(rng, log_uniform(rng, *PROMPT_RANGE))
        arrivals.append(Arrival(clock, prompt, rng.randint(*OUTPUT_RANGE)))
        clock += rng.expovariate(1.0)
    return arrivals


class _Recorder:
    def __init__(self, name: str, store: dict[str, list[float]]) -> None:
        self.name, self.store = name, store

    def inc(self, amount: float, labels: dict[str, str]) -> None:
        self.store[self.name].append(amount)

    def initialize(self, labels: dict[str, str]) -> None:
        pass

    def set(self, value: float, labels: dict[str, str]) -> None:
        pass

    def observe(self, value: float, labels: dict[str, str]) -> None:
        self.store[self.name].append(value)


class RecordingSink:
    """A MetricsSink that keeps every observation, for exact percentiles."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = defaultdict(list)

    def counter(self, name: str, description: str, label_names: Sequence[str]) -> _Recorder:
        return _Recorder(name, self.values)

    gauge = counter

    def histogram(
        self, name: str, description: str, buckets: Sequence[float], label_names: Sequence[str]
    ) -> _Recorder:
        return _Recorder(name, self.values)


class System:
    """An engine with one setting, kept across the rates it is measured at."""

    def __init__(self, settings: dict, num_threads: int | None = None) -> None:
        from replica_engine.metrics import EngineMetrics

        self.sink = RecordingSink()
        # The core on a thread of this process, where a step listener can see its steps.
        on_a_thread = {**settings, "core_process": False}
        self.engine = engine_as_served(on_a_thread, EngineMetrics(self.sink, "bench"), num_threads)
        self.steps: list[StepSummary] = []  # every step of the latest run
        # Idle now: the step thread reads it later.
        self.engine.client.core.step_listeners.append(self.steps.append)

    def run(self, arrivals: list[Arrival], rate: float) -> dict:
        """Replay the workload at `rate` requests/s; the point's figures (read from the engine's
        own metrics and steps, not the client's)."""
        self.sink.values.clear()
        self.steps.clear()
        client = EngineClient(self.engine)
        wall, _ = asyncio.run(
            open_loop(lambda arrival: client.send(arrival.prompt, greedy(arrival.max_tokens)), arrivals, rate)
        )
        values = self.sink.values
        tbt, delay, budget = values[TBT], values[QUEUE_TIME], values[BUDGET]
        return {
            "rate": rate,
            "requests": len(arrivals),
            "tbt_samples": len(tbt),
            "wall_s": round(wall, 2),
            "tbt_p50_s": percentile(tbt, 0.5),
            "tbt_p99_s": percentile(tbt, 0.99),
            "scheduling_delay_p50_s": statistics.median(delay),
            "output_tok_per_s": sum(a.max_tokens for a in arrivals) / wall,
            "step_p50_s": percentile([step.duration_s for step in self.steps], 0.5),
            "token_budget_p50": percentile(budget, 0.5) if budget else None,
        }

    def shutdown(self) -> None:
        self.engine.shutdown()


def decode_step_s() -> float:
    """The median decode-only step at batch 8 (512-token prompts): the unit Sarathi's SLOs are
    stated in."""
    batch, prompt_len = 8, 512
    system = System({"enable_prefix_caching": False})
    try:
        rng = random.Random(7)
        arrivals = [Arrival(0.0, random_tokens(rng, prompt_len), 48) for _ in range(batch)]
        system.run(arrivals, rate=1.0)
    finally:
        system.shutdown()
    full = [s.duration_s for s in system.steps if s.num_decode_requests == batch and not s.num_prefill_tokens]
    return statistics.median(full)
