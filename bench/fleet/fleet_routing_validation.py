"""Does the fleet simulator rank routers as real replicas do? Issue 42 part 3: bench.fleet.fleet's
workloads (a) (tenants, no eviction) and (b) (Zipf tenants, eviction) at 2 replicas, served by 2
real CPU replicas of SmolLM2 behind each router on one local Ray cluster, and by the simulator on
the same trace, at 3 seeds.

    python -m bench fleet_routing_validation [--seeds 0 1 2] [--routers kv_prefix prefix_cache_affinity]

The trace is bench.fleet.fleet's, its prompts written as English text (bench/text_prompts.py): a
tenant's context an excerpt of about its context's tokens, then one of about the request's own
tokens. Real clients send the text (Ray's router matches characters of it); the simulator gets
the token ids the app's tokenizer makes of it, the ids the real replicas cache. Scaled to what
this machine's 2 cores serve: each replica 1 torch thread and 256 blocks, the tenants' contexts
500 tokens instead of 2,000 (as many tenants as the workload's share of the fleet's KV asks
for), and the rates 0.1x the CPU profile's. On a host without AVX-512 (torch's ops, 1 thread)
the simulated fleet keeps up at 0.1x (TTFT p90 3-8 s) and not at 0.2x (30-90 s). The simulator's
step time is fitted in the same run, on the startup profile of an engine built as the replicas
are.

Goal: per workload, the simulator's TTFT p90 ratio between the routers (median over seeds of
kv_prefix / the other, paired by seed) within 25% of the real ratio. Writes
bench/results/fleet_routing_validation.json."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import http_load
from bench.driver import Arrival, BenchmarkRun, Spread, engine_as_served, print_verdicts
from bench.fleet.fleet import WORKLOADS, TenantWorkload
from bench.fleet.fleet_profiles import Profile
from bench.text_prompts import english_text, excerpt
from common.latency import summarize
from fleet_sim.fleet import Fleet, FleetConfig
from fleet_sim.records import summarize_records
from fleet_sim.replica import ReplicaConfig
from fleet_sim.routers import make_router
from fleet_sim.trace import SimRequest
from harness import serve_cluster
from harness.metrics_scrape import EngineCounters
from replica_engine.scheduler.step_time_model import StepTimeModel
from replica_engine.step_profile import profile_step_times

SEEDS = (0, 1, 2)
WORKLOAD_NAMES = ("a", "b")
ROUTERS = ("kv_prefix", "prefix_cache_affinity")  # ours, and Ray Serve LLM's: both run in Serve
NUM_REPLICAS = 2
REPLICA = ReplicaConfig(num_kv_blocks=256, max_num_batched_tokens=256, max_num_seqs=64)
CONTEXT_TOKENS = 500  # each tenant's (bench.fleet.fleet's: 2,000)
RATE_SCALE = 0.1  # of the CPU profile's rates
MAX_ONGOING_REQUESTS = 128  # serve_config.yaml's
ENGINE = {
    "num_kv_blocks": REPLICA.num_kv_blocks,
    "max_num_batched_tokens": REPLICA.max_num_batched_tokens,
    "max_num_seqs": REPLICA.max_num_seqs,
    "max_model_len": 2048,
}
APP_ARGS = {
    "num_replicas": NUM_REPLICAS,
    "num_cpus": 0,
    "cpu_threads": 1,
    "max_ongoing_requests": MAX_ONGOING_REQUESTS,
    "engine": ENGINE,
}
FIGURES = ("ttft_p50_s", "ttft_p90_s", "output_tok_per_s", "hit_rate")
GOALS = {"ttft_p90_ratio_error_max": 0.25}


@dataclasses.dataclass(frozen=True)
class TextRequest:
    """A trace request as both sides get it: the text a client sends, the ids a replica caches."""

    text: str
    request: SimRequest


def scaled_workload(name: str) -> TenantWorkload:
    return dataclasses.replace(WORKLOADS[name], context_tokens=CONTEXT_TOKENS)


def as_text(
    requests: list[SimRequest], context_tokens: int, tokenize: Callable[[str], list[int]], rng: random.Random
) -> list[TextRequest]:
    """Each request's prompt written as text: its tenant's context (the same excerpt for every
    request of the tenant), then an excerpt of its own; everything else as the trace has it."""
    text = english_text()
    contexts: dict[str, str] = {}
    written = []
    for request in requests:
        if request.tenant not in contexts:
            contexts[request.tenant] = f"Tenant {request.tenant}. " + excerpt(rng, text, context_tokens)
        own_tokens = len(request.prompt_token_ids) - context_tokens
        prompt = contexts[request.tenant] + excerpt(rng, text, own_tokens)
        written.append(
            TextRequest(prompt, dataclasses.replace(request, prompt_token_ids=tuple(tokenize(prompt))))
        )
    return written


def simulate(profile: Profile, requests: list[SimRequest], router: str, seed: int) -> dict[str, float]:
    config = FleetConfig(NUM_REPLICAS, profile.replica, profile.max_ongoing_requests)
    fleet = Fleet(config, profile.step_time, make_router(router, seed))
    return summarize_records(fleet.run(requests))


def serve_real(
    cluster: serve_cluster.ServeCluster, router: str, trace: list[TextRequest]
) -> dict[str, float]:
    """The trace sent open loop to the router's app, unsalted (routed by prefix); the fleet's hit
    rate from the replicas' counters."""
    before = EngineCounters.scrape(cluster, router)
    arrivals = [Arrival(t.request.arrival_s, t.text, t.request.max_tokens) for t in trace]
    url = f"{cluster.base_url}/{router}/v1/completions"
    wall, timings = asyncio.run(http_load.open_loop(url, arrivals, salted=False))
    time.sleep(3)  # replicas report metrics every second
    counted = EngineCounters.scrape(cluster, router).since(before)
    return summarize(wall, timings) | {"hit_rate": counted.hit_rate}


def judge(real: dict, simulated: dict, routers: tuple[str, ...]) -> tuple[dict, dict[str, bool]]:
    """Per workload and router against ROUTERS[0]: the TTFT p90 ratio over seeds (paired), real
    and simulated, and the simulated one's error."""
    ratios, met = {}, {}
    ours = routers[0]
    for workload in real:
        for other in routers[1:]:
            name = f"({workload}) TTFT p90 {ours} / {other}"
            pair = {
                side: Spread.of_ratios(runs[workload][ours], runs[workload][other], "ttft_p90_s")
                for side, runs in (("real", real), ("simulated", simulated))
            }
            error = pair["simulated"].median / pair["real"].median - 1
            ratios[name] = {side: vars(spread) for side, spread in pair.items()} | {"error": error}
            met[f"{name}: simulated within 25% of real"] = abs(error) <= GOALS["ttft_p90_ratio_error_max"]
    return ratios, met


def print_table(real: dict, simulated: dict, ratios: dict) -> None:
    print(f"{'workload':8} {'router':22} {'side':10}" + "".join(f"{f:>24}" for f in FIGURES))
    for workload, by_router in real.items():
        for router in by_router:
            for side, runs in (("real", real), ("simulated", simulated)):
                spreads = (Spread.of_runs(runs[workload][router], figure) for figure in FIGURES)
                cells = "".join(f"{format(spread, '.3f'):>24}" for spread in spreads)
                print(f"{workload:8} {router:22} {side:10}{cells}")
    for name, ratio in ratios.items():
        real_ratio, simulated_ratio = Spread(**ratio["real"]), Spread(**ratio["simulated"])
        print(f"{name}: real {real_ratio:.2f}, simulated {simulated_ratio:.2f}, error {ratio['error']:+.0%}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument(
        "--routers", nargs="+", default=list(ROUTERS), help="the first is compared with each other"
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/fleet_routing_validation.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("fleet_routing_validation", args.output, GOALS)
    engine = engine_as_served({**ENGINE, "core_process": False}, num_threads=1)  # as a replica runs
    try:
        core = engine.client.core
        step_time = StepTimeModel()
        step_time.fit_profile(profile_step_times(core.runner, core.config, engine.inputs.num_kv_blocks))
        description = "2 CPU replicas of SmolLM2, 1 thread each (step time profiled in this run)"
        profile = Profile(description, REPLICA, step_time, RATE_SCALE, MAX_ONGOING_REQUESTS)
        tokenize = engine.inputs.prompts.tokenize
        traces = {
            # Text drawn per workload and seed: no run finds a context an earlier run left cached.
            (name, seed): as_text(
                scaled_workload(name).requests(profile, NUM_REPLICAS, seed),
                CONTEXT_TOKENS,
                tokenize,
                random.Random(f"{name}/{seed}"),
            )
            for name in WORKLOAD_NAMES
            for seed in args.seeds
        }
    finally:
        engine.shutdown()
    routers = tuple(args.routers)
    simulated = {w: {r: [] for r in routers} for w in WORKLOAD_NAMES}
    real = {w: {r: [] for r in routers} for w in WORKLOAD_NAMES}
    for (workload, seed), trace in traces.items():
        for router in routers:
            summary = simulate(profile, [t.request for t in trace], router, seed)
            simulated[workload][router].append({"seed": seed, **summary})
    body = {
        "settings": {"seeds": args.seeds, "routers": routers, "replicas": APP_ARGS,
                     "workloads": {w: vars(scaled_workload(w)) for w in WORKLOAD_NAMES},
                     "rate_scale": RATE_SCALE, "coefficients": list(step_time.coefficients),
                     "requests": {f"({w}) seed {s}": len(t) for (w, s), t in traces.items()}},
        "real": real,
        "simulated": simulated,
    }  # fmt: skip
    work_dir = Path(tempfile.mkdtemp(prefix="bench-routing-validation-"))
    apps = {router: {**APP_ARGS, "request_router": router} for router in routers}
    cluster = serve_cluster.start(
        serve_cluster.config_with_apps(work_dir / "serve_config.yaml", apps), work_dir
    )
    try:
        for router in routers:
            cluster.wait_ready(f"/{router}")
            warm = {"prompt": "Warm up.", "max_tokens": 2}
            serve_cluster.post_concurrently(f"{cluster.base_url}/{router}/v1/completions", warm, 4)
        for seed in args.seeds:  # seed by seed, so host drift falls on every router alike
            for workload in WORKLOAD_NAMES:
                for router in routers:
                    summary = serve_real(cluster, router, traces[workload, seed])
                    real[workload][router].append({"seed": seed, **summary})
                    print(workload, router, seed, {f: round(summary[f], 3) for f in FIGURES}, flush=True)
                    run.write(body, goals_met={})  # so far, if the run breaks
    finally:
        serve_cluster.stop(cluster)
    body["ratios"], goals_met = judge(real, simulated, routers)
    print_table(real, simulated, body["ratios"])
    print_verdicts(goals_met)
    run.write(body, goals_met)


if __name__ == "__main__":
    main()
