"""Routing where caches differ, at fleet sizes one machine cannot run: the fleet simulator
(fleet_sim/), every router, 3 seeds (median and spread), on a process pool (a simulation is one
single-threaded process). The plan (PLAN, or --run PROFILE:WORKLOADS:SIZES): every workload at 4
and 16 CPU replicas, (a) and (b) at 64, and (a)-(c) at 4 H100 replicas: what fits in an hour here.

Workloads (tenants with shared contexts; each request its tenant's context plus tokens of its own,
32-128 tokens out; Poisson arrivals, per replica, ramping linearly over 120 s):
  (a) llm-d's shape scaled to our pools: 2,000-token contexts, working set 0.7x the fleet's KV
      (several times one replica's), equal popularity, 0.5 -> 2.5 requests/s;
  (b) Zipf popularity (s = 1.1) over a working set 1.5x the fleet's KV: eviction; 1.5 requests/s;
  (c) conversations (each arrival starts one of 3-8 turns; a turn resends the conversation, adds
      its last output and 50-150 new tokens, 5 s mean think time) after 1,000-token system
      prompts, 0.3x the KV; 0.2 -> 0.8 conversations/s;
  (d) long unique suffixes (500-1,500 tokens) after 1,000-token shared prefixes, 0.3x the KV;
      0.3 -> 0.9 requests/s;
  (e) (a) with replica 0 dying at 40 s (Serve's replacement, empty cache, serves 30 s later).
Profiles (bench/fleet/fleet_profiles.py): `cpu`, replicas as serve_config.yaml ships them on this CPU
(1 GiB KV pool = 2,911 blocks, 256-token budget, 64 sequences, max_ongoing_requests 128) with the
step time this machine's engine learned in bench.fleet.fleet_validation's run; `h100-llama3-8b`,
Llama-3-8B as vLLM would run it on an H100 (90% of 80 GB: 25,719 blocks; 8,192-token budget; 256
sequences) with fleet_sim/roofline.py's step time, the rates above scaled by what such a replica
serves over a CPU one (the lesser of the prefill and decode capacity ratios: x25.8).

Issue 42's goals, at every profile x workload x size run: kv_prefix's TTFT p90 <= 1.0x the best
baseline's (Ray's PrefixCacheAffinityRouter, SGLang's sgl-router cache-aware policy, llm-d's
precise prefix-cache scorers: fleet_sim/), and <= 0.3x Ray's where caches differ ((b), (e)); its
output tok/s >= 1.0x the best baseline's; the simulator >= 100x real time at 16 replicas. Writes
bench/results/fleet.json and .png."""

from __future__ import annotations

import argparse
import functools
import math
import multiprocessing
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from bench.driver import BenchmarkRun, Spread, print_verdicts, pyplot
from bench.fleet.fleet_profiles import PROFILES, Profile
from fleet_sim.fleet import Fleet, FleetConfig
from fleet_sim.records import summarize_records
from fleet_sim.roofline import RooflineStepTime
from fleet_sim.routers import ROUTERS, make_router
from fleet_sim.trace import NextTurn, SimRequest
from harness.random_workload import zipf_weights
from replica_engine.scheduler.step_time_model import StepTimeModel

SEEDS = (0, 1, 2)
# What one run simulates (profile:workloads:replicas): every workload at 4 and 16 CPU replicas;
# 64 replicas and the H100 profile where their simulations fit in this benchmark's hour.
PLAN = ("cpu:a,b,c,d,e:4,16", "cpu:a,b:64", "h100-llama3-8b:a,b,c:4")
DURATION_S = 120.0
FIGURES = ("ttft_p50_s", "ttft_p90_s", "tbt_p99_s", "output_tok_per_s", "hit_rate")
BASELINES = ("prefix_cache_affinity", "sglang_cache_aware", "llmd_precise_prefix")  # Ray's, SGLang's, llm-d's
CACHES_DIFFER = ("b", "e")  # eviction, a replica lost: Ray's tree no longer says what replicas hold
GOALS = {  # issue 42's, per profile x workload x size
    "ttft_p90_vs_best_baseline_max": 1.0,
    "ttft_p90_vs_ray_where_caches_differ_max": 0.3,
    "output_tok_per_s_vs_best_baseline_min": 1.0,
    "simulated_x_real_time_at_16_replicas_min": 100.0,
}


@dataclass(frozen=True)
class Conversations:
    turns: tuple[int, int] = (1, 1)  # per conversation (each arrival starts one)
    mean_think_s: float = 1.0  # between a turn's last token and the next turn


@dataclass(frozen=True)
class TenantWorkload:
    description: str
    context_tokens: int
    working_set_of_fleet_kv: float
    own_tokens: tuple[int, int]
    ramp_per_replica: tuple[float, float]  # requests/s at the start and at the end
    zipf_s: float | None = None  # tenant popularity ~ 1 / rank^s; None: equal
    fail_replica_0_at_s: float | None = None
    conversations: Conversations = Conversations()

    def requests(self, profile: Profile, num_replicas: int, seed: int) -> list[SimRequest]:
        """Tenants to fill the fleet's pools as described; rates scaled to the replicas' speed."""
        replica = profile.replica
        fleet_tokens = num_replicas * replica.num_kv_blocks * replica.block_size
        num_tenants = round(self.working_set_of_fleet_kv * fleet_tokens / self.context_tokens)
        rates = tuple(rate * num_replicas * profile.rate_scale for rate in self.ramp_per_replica)
        return tenant_requests(
            seed, num_tenants, self.context_tokens, self.own_tokens, rates, DURATION_S, self.zipf_s,
            self.conversations,
        )  # fmt: skip


def tenant_requests(
    seed: int,
    num_tenants: int,
    context_tokens: int,
    own_tokens: tuple[int, int],
    rates: tuple[float, float],
    duration_s: float,
    zipf_s: float | None = None,
    conversations: Conversations = Conversations(),
) -> list[SimRequest]:
    """Each request its tenant's context plus `own_tokens` of its own, 32-128 out; Poisson
    arrivals whose rate ramps linearly from rates[0] to rates[1] over `duration_s`. With more
    than one turn, each arrival starts a conversation whose later turns each add the last
    output and `own_tokens` more, sent an exponential think time after the last turn ended."""
    rng = random.Random(seed)
    contexts = [tuple(rng.randrange(1, 32000) for _ in range(context_tokens)) for _ in range(num_tenants)]
    weights = zipf_weights(num_tenants, zipf_s) if zipf_s else None
    low, high = rates

    def own() -> tuple[int, ...]:
        return tuple(rng.randrange(1, 32000) for _ in range(rng.randint(*own_tokens)))

    requests, now = [], 0.0
    while True:
        now += rng.expovariate(low + (high - low) * now / duration_s)
        if now >= duration_s:
            return requests
        tenant = rng.choices(range(num_tenants), weights)[0] if weights else rng.randrange(num_tenants)
        request_id, prompt, max_tokens = f"r{len(requests)}", contexts[tenant] + own(), rng.randint(32, 128)
        next_turn = None
        if conversations.turns != (1, 1):  # (single turns draw nothing more: the same requests as before)
            for turn in range(rng.randint(*conversations.turns), 1, -1):  # built last turn first
                think_s = rng.expovariate(1 / conversations.mean_think_s)
                next_turn = NextTurn(f"{request_id}/{turn}", think_s, own(), rng.randint(32, 128), next_turn)
        requests.append(SimRequest(request_id, now, prompt, max_tokens, str(tenant), None, next_turn))


WORKLOADS = {
    "a": TenantWorkload(
        "tenants x 2,000-token contexts, 0.7x the fleet's KV, ramp", 2000, 0.7, (32, 128), (0.5, 2.5)
    ),
    "b": TenantWorkload(
        "Zipf tenants, 1.5x the fleet's KV (eviction)", 2000, 1.5, (32, 128), (1.5, 1.5), zipf_s=1.1
    ),
    "c": TenantWorkload(
        "conversations of 3-8 turns after 1,000-token system prompts, ramp",
        1000,
        0.3,
        (50, 150),
        (0.2, 0.8),
        conversations=Conversations((3, 8), mean_think_s=5.0),
    ),
    "d": TenantWorkload(
        "500-1,500-token suffixes after 1,000-token prefixes", 1000, 0.3, (500, 1500), (0.3, 0.9)
    ),
    "e": TenantWorkload(
        "(a) with replica 0 dying at 40 s", 2000, 0.7, (32, 128), (0.5, 2.5), fail_replica_0_at_s=40.0
    ),
}


@functools.cache
def profile_named(name: str) -> Profile:
    return PROFILES[name]()


def run_point(point: tuple[str, str, int, str, int]) -> dict:
    """One simulation: (profile, workload, replicas, router, seed)."""
    profile_name, workload_name, num_replicas, router, seed = point
    profile, workload = profile_named(profile_name), WORKLOADS[workload_name]
    started = time.perf_counter()
    config = FleetConfig(num_replicas, profile.replica, profile.max_ongoing_requests)
    fleet = Fleet(config, profile.step_time, make_router(router, seed))
    if workload.fail_replica_0_at_s is not None:
        fleet.fail_replica_at(workload.fail_replica_0_at_s, "replica-0")
    summary = summarize_records(fleet.run(workload.requests(profile, num_replicas, seed)))
    return summary | {"sim_wall_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument(
        "--run", action="append", metavar="PROFILE:WORKLOADS:SIZES[:ROUTERS]",
        help=f"e.g. cpu:a,b:4,16 (repeatable; default: {' '.join(PLAN)}); profiles: {list(PROFILES)}; "
        f"routers (default all): {list(ROUTERS)}",
    )  # fmt: skip
    parser.add_argument("--processes", type=int, default=os.cpu_count(), help="simulations at once")
    parser.add_argument("--output", type=Path, default=Path("bench/results/fleet.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("fleet", args.output, GOALS)
    points = [
        (profile, workload, int(size), router, seed)
        for entry in args.run or PLAN
        for profile, workloads, sizes, routers in [_plan_entry(entry)]
        for workload in workloads.split(",")
        for size in sizes.split(",")
        for router in routers
        for seed in SEEDS
    ]
    results: dict[str, dict[str, dict[str, dict[str, list[dict]]]]] = {}
    with multiprocessing.Pool(args.processes) as pool:  # each simulation is one single-threaded process
        for point, summary in zip(points, pool.imap(run_point, points), strict=True):
            profile, workload, size, router, _ = point
            by_router = results.setdefault(profile, {}).setdefault(workload, {}).setdefault(str(size), {})
            runs = by_router.setdefault(router, [])
            runs.append(summary)
            if len(runs) == len(SEEDS):
                print_row(f"{profile} ({workload}) {size:3} replicas  {router:22}", runs)
    body = {
        "settings": {"seeds": SEEDS, "duration_s": DURATION_S, "processes": args.processes,
                     "workloads": {name: vars(WORKLOADS[name]) for name in {p[1] for p in points}},
                     "profiles": {name: describe(profile_named(name)) for name in results}},
        "results": results,
    }  # fmt: skip
    goals_met = judge(results, body)
    plot(args.output.with_suffix(".png"), results)
    print_verdicts(goals_met)
    run.write(body, goals_met)


def _plan_entry(entry: str) -> tuple[str, str, str, list[str]]:
    """PROFILE:WORKLOADS:SIZES[:ROUTERS] -> its parts; every router unless some are named (a slow
    profile's run can leave out the routers no goal compares)."""
    parts = entry.split(":")
    if len(parts) not in (3, 4):
        raise SystemExit(f"--run {entry}: expected PROFILE:WORKLOADS:SIZES[:ROUTERS]")
    routers = parts[3].split(",") if len(parts) == 4 else list(ROUTERS)
    if unknown := [r for r in routers if r not in ROUTERS]:
        raise SystemExit(f"--run {entry}: routers {unknown} are not among {list(ROUTERS)}")
    return parts[0], parts[1], parts[2], routers


def describe(profile: Profile) -> dict:
    step_time = profile.step_time
    if isinstance(step_time, StepTimeModel):
        how = {"coefficients": list(step_time.coefficients)}
    else:
        assert isinstance(step_time, RooflineStepTime)
        how = {"roofline": {"accelerator": vars(step_time.accelerator), "model_cost": vars(step_time.cost)}}
    return {"description": profile.description, "replica": vars(profile.replica),
            "rate_scale": profile.rate_scale, "max_ongoing_requests": profile.max_ongoing_requests,
            "step_time": how}  # fmt: skip


def print_row(label: str, runs: list[dict]) -> None:
    cells = "  ".join(f"{figure} {Spread.of_runs(runs, figure):.3f}" for figure in FIGURES)
    print(f"{label} {cells}  (simulated in {Spread.of_runs(runs, 'sim_wall_s'):.0f} s)", flush=True)


def judge(results: dict, body: dict) -> dict[str, bool]:
    """kv_prefix against the best baseline (the lowest median TTFT p90 / highest tok/s of Ray's,
    SGLang's and llm-d's routers) at every point, against Ray's where caches differ, and the
    simulator's speed at 16 replicas; ratios paired seed by seed."""
    met: dict[str, bool] = {}
    body["ratios"] = {}

    def check(name: str, spread: Spread, bound: float, is_max: bool) -> None:
        ok = spread.median <= bound if is_max else spread.median >= bound
        body["ratios"][name] = vars(spread)
        print(f"{name} ({'<=' if is_max else '>='} {bound}x): {spread:.2f}{'' if ok else '  MISS'}")
        met[f"{name} {'<=' if is_max else '>='} {bound}x"] = ok

    for profile, by_workload in results.items():
        for workload, by_size in by_workload.items():
            for size, runs in by_size.items():
                baselines = [b for b in BASELINES if b in runs]
                if "kv_prefix" not in runs or not baselines:
                    continue
                ours, at = runs["kv_prefix"], f"{profile} ({workload}) {size}"
                fastest = min(baselines, key=lambda b: Spread.of_runs(runs[b], "ttft_p90_s").median)
                richest = max(baselines, key=lambda b: Spread.of_runs(runs[b], "output_tok_per_s").median)
                check(f"{at}: TTFT p90 / {fastest}'s", Spread.of_ratios(ours, runs[fastest], "ttft_p90_s"),
                      GOALS["ttft_p90_vs_best_baseline_max"], True)  # fmt: skip
                check(f"{at}: tok/s / {richest}'s", Spread.of_ratios(ours, runs[richest], "output_tok_per_s"),
                      GOALS["output_tok_per_s_vs_best_baseline_min"], False)  # fmt: skip
                if workload in CACHES_DIFFER and "prefix_cache_affinity" in runs:
                    vs_ray = Spread.of_ratios(ours, runs["prefix_cache_affinity"], "ttft_p90_s")
                    check(f"{at}: TTFT p90 / prefix_cache_affinity's", vs_ray,
                          GOALS["ttft_p90_vs_ray_where_caches_differ_max"], True)  # fmt: skip
        timed = by_workload.get("a", {}).get("16", {}).get("kv_prefix")
        if timed:
            speed = Spread.of(DURATION_S / run["sim_wall_s"] for run in timed)
            check(f"{profile} (a) 16: simulated / real time, kv_prefix", speed,
                  GOALS["simulated_x_real_time_at_16_replicas_min"], False)  # fmt: skip
    return met


def plot(path: Path, results: dict) -> None:
    """Per profile and workload, TTFT p90 and hit rate per router and fleet size (medians of the
    seeds)."""
    plt = pyplot()
    rows = [
        (profile, name, by_size)
        for profile, by_workload in results.items()
        for name, by_size in by_workload.items()
    ]
    figure, axes = plt.subplots(len(rows), 2, figsize=(12, 3.6 * len(rows)), squeeze=False)
    # the routers this run had (a run may name some): a bar slot and a legend entry each
    routers = [r for r in ROUTERS if any(r in runs for _, _, by_size in rows for runs in by_size.values())]
    width = 0.8 / len(routers)
    for (profile, name, by_size), (ttft_axis, hit_axis) in zip(rows, axes, strict=True):
        sizes = list(by_size)
        for i, router in enumerate(routers):
            xs = [j + i * width for j in range(len(sizes))]
            for axis, key in ((ttft_axis, "ttft_p90_s"), (hit_axis, "hit_rate")):
                medians = [  # no bar where a router did not run at this size
                    Spread.of_runs(by_size[size][router], key).median if router in by_size[size] else math.nan
                    for size in sizes
                ]
                axis.bar(xs, medians, width, label=router)
        for axis, title in ((ttft_axis, "TTFT p90 (s)"), (hit_axis, "prefix-cache hit rate")):
            axis.set_xticks(
                [j + 0.4 - width / 2 for j in range(len(sizes))], [f"{s} replicas" for s in sizes]
            )
            axis.set_title(f"{profile} ({name}) {WORKLOADS[name].description}: {title}", fontsize=9)
        ttft_axis.set_yscale("log")
    axes[0][0].legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
