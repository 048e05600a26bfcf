"""Is the fleet simulator right? The same Poisson workload served by the real engine (SmolLM2, as
serve_config.yaml builds a replica's, in this process) and by one simulated replica with the same
settings, at 2 rates, for 3 arrival seeds; the simulator's step time from coefficients fitted on this machine
in the same run, two ways: the engine's startup profile (what a replica with `tbt_slo_s` fits
before taking requests) and the real run's own steps (what such a replica has learned after it).

Issue 25's goal: median absolute error <= 15% over TTFT p50/p90, TBT p50/p99 and output tok/s
(BLIS reports 17.6% TTFT / 7.1% ITL, Vidur < 9%). Writes bench/results/fleet_validation.json.
The router benchmark's two-replica workloads are not simulated yet (they need conversations)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

from bench.driver import BenchmarkRun, EngineClient, engine_as_served, greedy, print_verdicts
from bench.engine.capacity_run import workload
from common.latency import summarize
from fleet_sim.fleet import Fleet, FleetConfig
from fleet_sim.records import summarize_records
from fleet_sim.replica import ReplicaConfig
from fleet_sim.routers import make_router
from fleet_sim.trace import SimRequest
from harness.pacing import open_loop
from replica_engine.scheduler.step_time_model import StepTimeModel
from replica_engine.step_profile import profile_step_times

SEEDS = (0, 1, 2)
NUM_REQUESTS = 48
RATES = (1.0, 2.0)  # requests/s: a replica busy; and near what it can serve on this machine
FIGURES = ("ttft_p50_s", "ttft_p90_s", "tbt_p50_s", "tbt_p99_s", "output_tok_per_s")
GOALS = {"median_abs_error_max": 0.15}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/fleet_validation.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("fleet_validation", args.output, GOALS)
    engine = engine_as_served({"core_process": False})  # on a thread: its steps are listened to here
    try:
        core, num_blocks = engine.client.core, engine.inputs.num_kv_blocks
        samples = profile_step_times(core.runner, core.config, num_blocks)
        profiled = StepTimeModel()
        profiled.fit_profile(samples)
        # As a replica refits: on the profile and its steps (a run's own steps alone leave decode
        # attention undetermined wherever its contexts were all alike).
        learned = StepTimeModel(window=100_000)
        learned.fit_profile(samples)
        core.step_listeners.append(lambda step: learned.observe(step.shape, step.duration_s))
        real = {(rate, seed): serve_real(engine, rate, seed) for rate in RATES for seed in SEEDS}
    finally:
        engine.shutdown()
    learned.refit()
    config = core.config
    replica = ReplicaConfig(
        num_kv_blocks=num_blocks,
        block_size=config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        scheduling_policy=config.scheduling_policy,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    models = {"startup_profile": profiled, "learned_from_run": learned}
    body: dict = {
        "settings": {"seeds": SEEDS, "requests": NUM_REQUESTS, "rates": RATES, "replica": vars(replica)}
    }
    body["coefficients"] = {name: list(model.coefficients) for name, model in models.items()}
    body["real"] = {_key(point): figures for point, figures in real.items()}
    body["simulated"], body["errors"] = {}, {}
    for name, model in models.items():
        simulated = {(rate, seed): simulate(replica, model, rate, seed) for rate, seed in real}
        errors = {f: [abs(simulated[p][f] / real[p][f] - 1) for p in real] for f in FIGURES}
        body["simulated"][name] = {_key(point): figures for point, figures in simulated.items()}
        body["errors"][name] = {f: statistics.median(e) for f, e in errors.items()}
        body["errors"][name]["median_over_figures"] = statistics.median(
            body["errors"][name][f] for f in FIGURES
        )
    goals_met = {
        f"median abs error <= 15% ({name})": body["errors"][name]["median_over_figures"]
        <= GOALS["median_abs_error_max"]
        for name in models
    }
    print_table(body)
    print_verdicts(goals_met)
    run.write(body, goals_met)


def _key(point: tuple[float, int]) -> str:
    rate, seed = point
    return f"rate {rate} seed {seed}"


def serve_real(engine, rate: float, seed: int) -> dict[str, float]:
    client = EngineClient(engine)
    arrivals = workload(NUM_REQUESTS, seed)
    wall, served = asyncio.run(
        open_loop(lambda arrival: client.send(arrival.prompt, greedy(arrival.max_tokens)), arrivals, rate)
    )
    return summarize(wall, [s.timing for s in served])


def simulate(replica: ReplicaConfig, model: StepTimeModel, rate: float, seed: int) -> dict[str, float]:
    requests = [
        SimRequest(f"r{i}", a.at_s / rate, tuple(a.prompt), a.max_tokens)
        for i, a in enumerate(workload(NUM_REQUESTS, seed))
    ]
    fleet = Fleet(
        FleetConfig(1, replica, max_ongoing_requests=10**6), model, make_router("round_robin", seed)
    )
    return summarize_records(fleet.run(requests))


def print_table(body: dict) -> None:
    """Per rate, the median over seeds of each figure, real and simulated two ways."""
    print(f"{'rate':>5} {'figure':18}{'real':>9}" + "".join(f"{name[:16]:>18}" for name in body["simulated"]))
    for rate in RATES:
        points = [_key((rate, seed)) for seed in SEEDS]
        for figure in FIGURES:
            real = statistics.median(body["real"][p][figure] for p in points)
            cells = ""
            for sims in body["simulated"].values():
                simulated = statistics.median(sims[p][figure] for p in points)
                cells += f"{simulated:11.3f} ({simulated / real - 1:+4.0%})"
            print(f"{rate:5.1f} {figure:18}{real:9.3f}{cells}")
    for name, errors in body["errors"].items():
        print(f"{name}: median abs error over figures {errors['median_over_figures']:.1%}")


if __name__ == "__main__":
    main()
