"""`python -m bench priority`: request priority on the real engine (SmolLM2, offline, step by step).

(a) 64 requests (prompts 16-96 tokens, outputs 4-16, greedy, a pool small enough to preempt), run
with `priority` left out and again with priority=0 on every request: the same steps (rows and
token counts) and the same tokens; for both, throughput, steps and the median time of a
schedule() call (the priority code's cost; wall-clock figures move with a shared host's load,
recorded too). (b) The same workload with half the requests at priority 1. (c) 48 requests at
priority 1 queue first, 16 at priority 0 arrive three steps later: their time to first token in
steps, against the same arrivals with priority left out (FCFS). Each run gets a fresh engine,
warmed before its clock starts."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.driver import BenchmarkRun, greedy, print_verdicts
from common.model_source import DEFAULT_MODEL
from harness.random_workload import random_tokens
from replica_engine import EngineConfig
from replica_engine.engine import LLMEngine
from replica_engine.scheduler.plan import ScheduledBatch

GOALS = {
    "a_identical_to_no_priority": "priority 0 everywhere: the same steps and tokens as priority left out",
    "c_high_ttft_below_low": "median TTFT in steps: late priority-0 requests < priority-1 ones",
}
# A pool of 32 16-token blocks for up to 16 requests of up to 112 tokens: it runs dry and preempts.
SETTINGS = {"max_num_batched_tokens": 256, "max_num_seqs": 16, "num_kv_blocks": 32}


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: list[int]
    max_tokens: int
    priority: int | None  # None: left out of SamplingParams
    arrival_step: int = 0


@dataclass
class Run:
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time: steadier than wall time on a shared host
    steps: list[tuple[tuple[str, int], ...]] = field(default_factory=list)  # each step's rows
    outputs: dict[str, list[int]] = field(default_factory=dict)
    ttft_steps: dict[str, int] = field(default_factory=dict)  # first token's step - arrival step
    schedule_s: list[float] = field(default_factory=list)  # each schedule() call: where priority works
    num_preemptions: int = 0

    def summary(self) -> dict[str, float]:
        num_output = sum(len(tokens) for tokens in self.outputs.values())
        return {
            "wall_s": round(self.wall_s, 2),
            "output_tok_per_s": round(num_output / self.wall_s, 1),
            "cpu_s": round(self.cpu_s, 2),
            "output_tok_per_cpu_s": round(num_output / self.cpu_s, 1),
            "num_steps": len(self.steps),
            "num_preemptions": self.num_preemptions,
            "schedule_us_p50": round(statistics.median(self.schedule_s) * 1e6, 1),
        }

    def median_ttft_steps(self, jobs: list[Job]) -> float:
        return statistics.median(self.ttft_steps[job.request_id] for job in jobs)


def workload(num_requests: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [
        Job(f"r{i}", random_tokens(rng, rng.randint(16, 96)), rng.randint(4, 16), None)
        for i in range(num_requests)
    ]


def with_priority(jobs: list[Job], priority_of: dict[str, int], arrival_of: dict[str, int]) -> list[Job]:
    return [
        Job(
            j.request_id,
            j.prompt,
            j.max_tokens,
            priority_of.get(j.request_id),
            arrival_of.get(j.request_id, 0),
        )
        for j in jobs
    ]


def run(jobs: list[Job]) -> Run:
    """Add each job at its arrival step and step a fresh engine until every one has finished."""
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, **SETTINGS))
    engine.add_request(jobs[0].prompt[:16], greedy(2), "warmup")
    while engine.has_unfinished_requests():
        engine.step()
    result = Run()
    schedule = engine.core.scheduler.schedule

    def recording_schedule() -> ScheduledBatch:
        began = time.perf_counter()
        batch = schedule()
        result.schedule_s.append(time.perf_counter() - began)
        if not batch.is_empty:
            result.steps.append(tuple((row.request_id, row.num_tokens) for row in batch.rows))
        return batch

    engine.core.scheduler.schedule = recording_schedule
    pending = sorted(jobs, key=lambda job: job.arrival_step)
    arrival = {job.request_id: job.arrival_step for job in jobs}
    step, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival_step <= step:
            job = pending.pop(0)
            extra = {} if job.priority is None else {"priority": job.priority}
            engine.add_request(job.prompt, greedy(job.max_tokens, **extra), job.request_id)
        for out in engine.step():
            result.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_token_ids:
                result.ttft_steps.setdefault(out.request_id, step - arrival[out.request_id])
        step += 1
    result.wall_s = time.perf_counter() - start
    result.cpu_s = time.process_time() - cpu_start
    result.num_preemptions = engine.stats().num_preemptions
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("bench/results/priority_cpu.json"))
    args = parser.parse_args()
    bench = BenchmarkRun("priority", args.output, GOALS)
    jobs = workload(args.num_requests, args.seed)
    ids = [job.request_id for job in jobs]
    left_out = run(jobs)
    zero = run(with_priority(jobs, dict.fromkeys(ids, 0), {}))
    halves = run(with_priority(jobs, {i: n % 2 for n, i in enumerate(ids)}, {}))
    # (c): the last quarter are urgent and arrive after the rest have queued.
    num_low = len(jobs) * 3 // 4
    low, high = jobs[:num_low], jobs[num_low:]
    late = {job.request_id: 3 for job in high}
    urgent = run(with_priority(jobs, dict.fromkeys(ids[:num_low], 1) | dict.fromkeys(ids[num_low:], 0), late))
    fcfs = run(with_priority(jobs, {}, late))

    identical = zero.steps == left_out.steps and zero.outputs == left_out.outputs
    mixed = {
        name: {
            **result.summary(),
            "high_ttft_steps_p50": result.median_ttft_steps(high),
            "low_ttft_steps_p50": result.median_ttft_steps(low),
        }
        for name, result in (("priority", urgent), ("fcfs", fcfs))
    }
    met = {
        "a_identical_to_no_priority": identical,
        "c_high_ttft_below_low": mixed["priority"]["high_ttft_steps_p50"]
        < mixed["priority"]["low_ttft_steps_p50"],
    }
    body = {
        "workload": {
            "model": DEFAULT_MODEL,
            "num_requests": args.num_requests,
            "seed": args.seed,
            "prompt_len": [16, 96],
            "output_len": [4, 16],
            "sampling": "greedy, ignore_eos",
            "c": f"{num_low} at priority 1 from step 0, {len(high)} at priority 0 from step 3",
        },
        "engine": SETTINGS,
        "a_priority_left_out": left_out.summary(),
        "a_priority_zero": {**zero.summary(), "identical_steps_and_tokens": identical},
        "b_half_priority_one": {
            **halves.summary(),
            # dtype auto is bf16 here: a near-tie can turn a greedy token when its batch mates change
            "requests_with_tokens_as_a": sum(halves.outputs[i] == left_out.outputs[i] for i in ids),
        },
        "c_late_urgent": mixed,
        "load_average_1_5_15m": os.getloadavg(),  # the host is shared: wall-clock figures vary with it
    }
    for name, figures in [("a left out", left_out.summary()), ("a priority 0", zero.summary())]:
        print(f"{name}: {figures}")
    print(f"b half at 1: {body['b_half_priority_one']}")
    for name, figures in mixed.items():
        print(f"c {name}: {figures}")
    print_verdicts(met)
    bench.write(body, met)


if __name__ == "__main__":
    main()
