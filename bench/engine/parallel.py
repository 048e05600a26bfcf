"""python -m bench parallel: Sarathi-Serve's pipeline claim on this CPU.

Sarathi-Serve's uniform, chunked batches keep pipeline stages evenly loaded: under prefill-first
batching a stage holding a whole prompt leaves the other waiting (a bubble); stall-free batches
cost about the same at every step. Measured: the real SmolLM2 (dtype auto, prefix caching off)
split in two pipeline stages, one worker process and one torch thread each, two batches in the
pipeline at once, under `prefill_first` (whole prompts, budget 2048) and `stall_free` (budget
256, serve_config's); beside them one process on both threads (`stall_free`, 256), the replica
that a 2-core machine would otherwise run. The engine core runs on a thread of this process (AsyncEngine, no
Ray), as in bench.engine.capacity.

Workload: bench.engine.capacity's (random prompts log-uniform 64-1024, outputs 16-128, Poisson
arrivals), on seeds 0, 1 and 2: each seed draws its own requests. A point replays as many as
arrive in WINDOW_S at its rate, and at least MIN_REQUESTS.

Bubble fraction, per stage: 1 - (seconds the stage computed steps, waits on the other stage left
out) / the point's wall time, read from the workers' own clocks; the pipeline's is the mean of its
stages'. Judged at BUBBLE_RATE (past what either pipeline sustains, so a stage idles only for
bubbles, not for want of work): goal stall_free's <= 0.5x prefill_first's (medians over seeds).

Capacity: bench.engine.capacity's SLOs (d = the median decode-only step at batch 8 of the one-process
engine, measured at start: strict P99 TBT <= 5 d, relaxed <= 25 d, median scheduling delay <= 80
d), on the rate grid RATES walked upwards until a point fails the relaxed SLO. Capacity = the
highest grid rate passed before that. Stated beside Sarathi's figure (up to 5.6x serving capacity
from pipeline parallelism with stall-free batches, Falcon-180B over two nodes); no goal on 2 cores.
Writes bench/results/parallel_cpu.json; about half an hour on 2 cores, not part of make test."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from bench.driver import Arrival, BenchmarkRun, Spread, print_verdicts
from bench.engine.capacity import DELAY_FACTOR, SLO_FACTORS, meets
from bench.engine.capacity_run import System, decode_step_s, workload

SYSTEMS = {
    "PP=2 prefill_first": {
        "pipeline_parallel_size": 2,
        "scheduling_policy": "prefill_first",
        "max_num_batched_tokens": 2048,
    },
    "PP=2 stall_free": {"pipeline_parallel_size": 2, "max_num_batched_tokens": 256},
    "1 process stall_free": {"max_num_batched_tokens": 256},
}
COMMON = {"enable_prefix_caching": False}
SEEDS = (0, 1, 2)
RATES = (0.5, 1.0, 1.41, 2.0, 2.83, 4.0, 5.66)  # requests/s, 2^(1/2) apart
BUBBLE_RATE = 4.0
WINDOW_S, MIN_REQUESTS = 16.0, 24
WARMUP_REQUESTS = 8  # replayed on each fresh engine before its points, unmeasured
GOALS = {
    "stall_free_bubble_0.5x_prefill_first": "PP=2: stall_free's pipeline bubble fraction <= 0.5x"
    f" prefill_first's at {BUBBLE_RATE} req/s (medians over seeds)",
}
SARATHI_PP_CAPACITY = "up to 5.6x serving capacity (Falcon-180B, pipeline parallel over two nodes)"


def stage_busy_s(system: System) -> list[float]:
    """The pipeline workers' computing seconds so far; [] for one process. Read between points,
    when the engine is idle (its step thread is not using the workers then)."""
    runner = system.engine.client.core.runner
    return runner.stage_busy_s() if hasattr(runner, "stage_busy_s") else []


def run_point(system: System, arrivals: list[Arrival], rate: float) -> dict:
    before = stage_busy_s(system)
    started = time.perf_counter()
    point = system.run(arrivals, rate)
    wall = time.perf_counter() - started
    busy = [after - b for after, b in zip(stage_busy_s(system), before, strict=True)]
    if busy:
        point["stage_bubble_fraction"] = [round(1 - seconds / wall, 4) for seconds in busy]
        point["bubble_fraction"] = statistics.mean(point["stage_bubble_fraction"])
    return point


def walk(system: System, arrivals: list[Arrival], slos: dict[str, float], delay_bound_s: float) -> dict:
    """The rate grid upwards until the relaxed SLO fails, and BUBBLE_RATE whatever happens.
    Capacity per SLO: the highest rate passed with every rate below it passed too."""
    points, capacity = [], dict.fromkeys(slos, 0.0)
    holding = set(slos)
    for rate in RATES:
        if "relaxed" not in holding and rate != BUBBLE_RATE:
            continue
        point = run_point(system, arrivals[: max(MIN_REQUESTS, round(rate * WINDOW_S))], rate)
        points.append(point)
        for name, slo in slos.items():
            if name in holding and meets(point, slo, delay_bound_s):
                capacity[name] = rate
            else:
                holding.discard(name)
        print(
            f"  {rate:.2f} req/s: TBT p99 {point['tbt_p99_s']:.3f} s, delay p50 "
            f"{point['scheduling_delay_p50_s']:.2f} s, {point['output_tok_per_s']:.0f} tok/s, bubbles "
            f"{point.get('stage_bubble_fraction', '-')}",
            flush=True,
        )
    return {"points": points, "capacity_req_per_s": capacity}


def at_rate(run: dict, rate: float) -> dict:
    return next(point for point in run["points"] if point["rate"] == rate)


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians and spreads over seeds: capacity per SLO; at BUBBLE_RATE the bubble fraction (None
    for one process), output tok/s and TBT p99."""
    summary: dict[str, dict] = {}
    for name, seeds in runs.items():
        figures: dict[str, Spread | None] = {
            f"capacity_{slo}_req_per_s": Spread.of(run["capacity_req_per_s"][slo] for run in seeds)
            for slo in SLO_FACTORS
        }
        at_bubble_rate = [at_rate(run, BUBBLE_RATE) for run in seeds]
        for key in ("output_tok_per_s", "tbt_p99_s", "bubble_fraction"):
            figures[key] = Spread.of_runs(at_bubble_rate, key) if key in at_bubble_rate[0] else None
        summary[name] = {key: None if f is None else dataclasses.asdict(f) for key, f in figures.items()}
    return summary


def print_table(summary: dict) -> None:
    print(
        f"| system | capacity strict | capacity relaxed | at {BUBBLE_RATE} req/s: bubble fraction | tok/s |"
        " TBT p99 s |"
    )
    print("|---|---|---|---|---|---|")
    for name, figures in summary.items():
        cells = [
            _cell(figures.get(key))
            for key in (
                "capacity_strict_req_per_s",
                "capacity_relaxed_req_per_s",
                "bubble_fraction",
                "output_tok_per_s",
                "tbt_p99_s",
            )
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


def _cell(figure: dict | None) -> str:
    return "-" if figure is None else f"{figure['median']:.3g} [{figure['min']:.3g}-{figure['max']:.3g}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("bench/results/parallel_cpu.json"))
    args = parser.parse_args()
    run = BenchmarkRun("parallel", args.output, GOALS)
    unit = decode_step_s()
    slos = {name: factor * unit for name, factor in SLO_FACTORS.items()}
    delay_bound_s = DELAY_FACTOR * unit
    print(f"d = {unit * 1000:.1f} ms: SLOs {slos}, delay bound {delay_bound_s:.2f} s", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    for seed in SEEDS:
        arrivals = workload(max(MIN_REQUESTS, round(max(RATES) * WINDOW_S)), seed)
        for name, settings in SYSTEMS.items():
            print(f"seed {seed}: {name}", flush=True)
            system = System({**COMMON, **settings})
            try:
                system.run(arrivals[:WARMUP_REQUESTS], BUBBLE_RATE)  # first passes at each shape are slow
                runs[name].append({"seed": seed, **walk(system, arrivals, slos, delay_bound_s)})
            finally:
                system.shutdown()
    summary = summarize(runs)
    print_table(summary)
    stall_free = summary["PP=2 stall_free"]["bubble_fraction"]["median"]
    prefill_first = summary["PP=2 prefill_first"]["bubble_fraction"]["median"]
    goals_met = {"stall_free_bubble_0.5x_prefill_first": stall_free <= 0.5 * prefill_first}
    print_verdicts(goals_met)
    body = {
        "method": __doc__,
        "systems": {name: {**COMMON, **settings} for name, settings in SYSTEMS.items()},
        "decode_step_batch8_s": unit,
        "slos_s": slos,
        "scheduling_delay_bound_s": delay_bound_s,
        "bubble_rate_req_per_s": BUBBLE_RATE,
        "bubble_ratio_stall_free_to_prefill_first": stall_free / prefill_first if prefill_first else None,
        "sarathi_figure": SARATHI_PP_CAPACITY,
        "summary": summary,
        "runs": runs,
    }
    run.write(body, goals_met)


if __name__ == "__main__":
    main()
