"""Where prefill/decode disaggregation beats stall-free colocation: the fleet simulator's map on
Llama-3-8B H100 replicas (bench/fleet/fleet_profiles.py's roofline profile), 4 GPUs each way.

Designs, on the same arrivals (paired seed by seed):
  colocated: 4 replicas of our stall-free scheduler with its TBT target (`tbt_slo_s` = the
      workload's TPOT objective: prompt chunks sized per step to keep it, Sarathi-Serve's point);
  colocated_8192: 4 replicas with vLLM's default 8,192-token budget and no TBT target;
  pd_1_3, pd_2_2, pd_3_1: prefill:decode replicas (fleet_sim/disaggregated.py), the KV over
      InfiniBand (NDR, 400 Gb/s a GPU, at 80%: 40 GB/s, 50 us a transfer), + a 2 ms Serve hop.
Workloads (uniform lengths, unique prompts, Poisson arrivals for 30 s; 3 seeds):
  chat: prompts 500-2,500 tokens, 100-400 out; TTFT <= 0.5 s, TPOT <= 40 ms;
  summarize: prompts 3,000-6,000, 50-200 out; TTFT <= 2 s, TPOT <= 40 ms;
  generate: prompts 100-400, 400-900 out; TTFT <= 0.3 s, TPOT <= 30 ms;
  chat_tight: chat's lengths, TPOT <= 15 ms (about two decode steps: where DistServe's case for
      the split is strongest, as a colocated step has little room left for prompt chunks).
A request attains its SLOs when its TTFT and its TPOT (its mean time between tokens, DistServe's
measure) are both within them; goodput = such requests per second. Loads: 0.5x, 0.9x and 1.2x the
rate at which the colocated fleet attains 90% (found first, by bisection on seed 0). Then, at
0.9x, the 2:2 split over NVLink (450 GB/s at 70%, 20 us) and TCP (25 GbE at 80%, 100 us).
Writes bench/results/disaggregation_map.json and .png."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench.driver import BenchmarkRun, Spread, print_verdicts, pyplot
from bench.fleet.fleet_profiles import h100_llama3_8b_profile
from fleet_sim.disaggregated import DisaggregatedConfig, DisaggregatedFleet, KvLink
from fleet_sim.fleet import Fleet, FleetConfig
from fleet_sim.records import RequestRecord, summarize_records
from fleet_sim.routers import make_router
from fleet_sim.trace import SimRequest

SEEDS = (0, 1, 2)
DURATION_S = 30.0
NUM_GPUS = 4
LOADS = (0.5, 0.9, 1.2)  # of the colocated fleet's 90%-attainment rate
SPLITS = {"pd_1_3": (1, 3), "pd_2_2": (2, 2), "pd_3_1": (3, 1)}
LINKS = {
    "infiniband": KvLink("infiniband", 50e-6, 0.8 * 50e9),
    "nvlink": KvLink("nvlink", 20e-6, 0.7 * 450e9),
    "tcp": KvLink("tcp", 100e-6, 0.8 * 25e9 / 8),
}
MAP_LINK = "infiniband"
HOP_S = 0.002
GOALS = {"map_cells_min": 27, "seeds_per_cell_min": 3}  # the issue's: 3 workloads x 3 splits x 3 loads


@dataclass(frozen=True)
class PdWorkload:
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    ttft_slo_s: float
    tpot_slo_s: float

    def requests(self, rate: float, seed: int) -> list[SimRequest]:
        rng = random.Random(seed)
        requests, now = [], 0.0
        while (now := now + rng.expovariate(rate)) < DURATION_S:
            prompt = tuple(rng.randrange(1, 32000) for _ in range(rng.randint(*self.prompt_tokens)))
            requests.append(SimRequest(f"r{len(requests)}", now, prompt, rng.randint(*self.output_tokens)))
        return requests

    def attains(self, record: RequestRecord) -> bool:
        timing = record.timing()
        tpot = (timing.e2e_s - timing.ttft_s) / max(1, timing.output_len - 1)
        return timing.ttft_s <= self.ttft_slo_s and tpot <= self.tpot_slo_s


WORKLOADS = {
    "chat": PdWorkload((500, 2500), (100, 400), 0.5, 0.040),
    "summarize": PdWorkload((3000, 6000), (50, 200), 2.0, 0.040),
    "generate": PdWorkload((100, 400), (400, 900), 0.3, 0.030),
    "chat_tight": PdWorkload((500, 2500), (100, 400), 0.5, 0.015),
}


def run_point(point: tuple[str, str, float, str, int]) -> dict:
    """One simulation: (workload, design, rate, link, seed)."""
    workload_name, design, rate, link, seed = point
    workload, profile = WORKLOADS[workload_name], h100_llama3_8b_profile()
    started = time.perf_counter()
    requests = workload.requests(rate, seed)
    extra = {}
    if design.startswith("pd_"):
        num_prefill, num_decode = SPLITS[design]
        config = DisaggregatedConfig(
            num_prefill, num_decode, profile.replica, profile.replica, LINKS[link],
            profile.step_time.cost.kv_bytes_per_token, HOP_S,  # type: ignore[attr-defined]
        )  # fmt: skip
        fleet = DisaggregatedFleet(
            config, profile.step_time, profile.step_time, make_router("kv_prefix", seed),
            make_router("kv_pressure", seed),
        )  # fmt: skip
        records = fleet.run(requests)
        transfer_s = sorted(arrived - exported for exported, arrived in fleet.transfers)
        extra = {"transfer_p50_s": transfer_s[len(transfer_s) // 2], "gb_moved": fleet.bytes_moved / 1e9}
    else:
        replica = profile.replica
        if design == "colocated":
            replica = replace(replica, tbt_slo_s=workload.tpot_slo_s)
        colocated = Fleet(FleetConfig(NUM_GPUS, replica, profile.max_ongoing_requests), profile.step_time,
                          make_router("kv_pressure", seed))  # fmt: skip
        records = colocated.run(requests)
    attained = sum(workload.attains(record) for record in records)
    summary = summarize_records(records)
    keep = ("ttft_p50_s", "ttft_p90_s", "tbt_p50_s", "tbt_p99_s", "output_tok_per_s")
    return (
        {key: summary[key] for key in keep}
        | extra
        | {
            "rate": rate,
            "attainment": attained / len(records),
            "goodput": attained / DURATION_S,
            "sim_wall_s": time.perf_counter() - started,
        }
    )


def colocated_capacity(workload: str) -> float:
    """The arrival rate at which the colocated fleet attains its SLOs for 90% of requests (seed 0):
    DistServe's per-GPU goodput, times the GPUs. A bracket by doubling, then bisection."""
    low, high = 0.0, 8.0

    def attains(rate: float) -> bool:
        return run_point((workload, "colocated", rate, MAP_LINK, 0))["attainment"] >= 0.9

    while attains(high):
        low, high = high, high * 2
    for _ in range(6):
        middle = (low + high) / 2
        low, high = (middle, high) if attains(middle) else (low, middle)
    return max(low, 0.1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {list(WORKLOADS)}")
    parser.add_argument("--processes", type=int, default=os.cpu_count(), help="simulations at once")
    parser.add_argument(
        "--capacities",
        help="e.g. chat=59.5,summarize=25.75: an earlier run's rates (its seed 0 bisection), not found again",
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/disaggregation_map.json"))
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the output's results (an earlier or stopped run, the same settings) and simulate "
        "only the points it lacks: its workloads stay in the map",
    )
    args = parser.parse_args(argv)
    run = BenchmarkRun("disaggregation_map", args.output, GOALS)
    earlier = json.loads(args.output.read_text()) if args.resume and args.output.exists() else {}
    results: dict = earlier.get("results", {})
    workloads = list(dict.fromkeys([*results, *args.workloads.split(",")]))
    with multiprocessing.Pool(args.processes) as pool:
        capacities = dict(earlier.get("colocated_capacity_rps", {}))
        if args.capacities:
            capacities |= {
                name: float(rate) for name, rate in (item.split("=") for item in args.capacities.split(","))
            }
        missing = [name for name in workloads if name not in capacities]
        capacities |= dict(zip(missing, pool.map(colocated_capacity, missing), strict=True))
        print(f"colocated 90%-attainment rates (requests/s): {capacities}", flush=True)
        designs = ["colocated", "colocated_8192", *SPLITS]
        points = [
            (workload, design, capacities[workload] * load, MAP_LINK, seed)
            for workload in workloads for load in LOADS for design in designs for seed in SEEDS
        ] + [
            (workload, "pd_2_2", capacities[workload] * LOADS[1], link, seed)
            for workload in workloads for link in LINKS if link != MAP_LINK for seed in SEEDS
        ]  # fmt: skip
        points = [point for point in points if not simulated(results, point, capacities)]
        body = {
            "settings": {
                "seeds": SEEDS, "duration_s": DURATION_S, "gpus": NUM_GPUS, "loads": LOADS, "hop_s": HOP_S,
                "links": {name: vars(link) for name, link in LINKS.items()}, "map_link": MAP_LINK,
                "workloads": {name: vars(WORKLOADS[name]) for name in workloads},
                "profile": h100_llama3_8b_profile().description,
            },
            "colocated_capacity_rps": capacities,
            "results": results,
        }  # fmt: skip
        for done, (point, summary) in enumerate(zip(points, pool.imap(run_point, points), strict=True), 1):
            workload, design, _, link, seed = point
            load = load_label(point, capacities)
            results.setdefault(workload, {}).setdefault(load, {}).setdefault(f"{design}@{link}", []).append(
                summary
            )
            print(f"[{done}/{len(points)}] {workload} {load} {design}@{link} seed {seed}: goodput "
                  f"{summary['goodput']:.2f}/s, attainment {summary['attainment']:.0%} "
                  f"(simulated in {summary['sim_wall_s']:.0f} s)", flush=True)  # fmt: skip
            if done % 10 == 0:
                run.write(body, {})  # so far, not judged: a stopped run keeps what it simulated
    goals_met = judge(body)
    plot(args.output.with_suffix(".png"), body)
    print_verdicts(goals_met)
    run.write(body, goals_met)


def load_label(point: tuple[str, str, float, str, int], capacities: dict[str, float]) -> str:
    workload, _, rate, _, _ = point
    return f"{rate / capacities[workload]:.1f}x"


def simulated(results: dict, point: tuple[str, str, float, str, int], capacities: dict[str, float]) -> bool:
    """Whether an earlier run holds the point: its runs of a cell are in seed order."""
    workload, design, _, link, seed = point
    runs = results.get(workload, {}).get(load_label(point, capacities), {}).get(f"{design}@{link}", [])
    return len(runs) > SEEDS.index(seed)


def goodput_ratio(runs: list[dict], base: list[dict]) -> Spread:
    """Goodput over the base's, seed by seed; a base that attained nothing counts as one request
    in the run (so an overloaded base gives a large ratio, not a division by zero)."""
    return Spread.of(
        run["goodput"] / max(other["goodput"], 1 / DURATION_S) for run, other in zip(runs, base, strict=True)
    )


def judge(body: dict) -> dict[str, bool]:
    """Each P/D split's goodput over colocated's, paired seed by seed, per workload and load: the
    map's cells (and the others' against colocated, for the record)."""
    cells, seeds, ratios = 0, [], {}
    for workload, by_load in body["results"].items():
        for load, by_design in by_load.items():
            base = by_design[f"colocated@{MAP_LINK}"]
            for design, runs in by_design.items():
                if design.startswith("colocated@"):
                    continue
                spread = goodput_ratio(runs, base)
                ratios[f"{workload} {load} {design}"] = vars(spread)
                print(f"{workload:9} {load} {design:26} goodput {Spread.of_runs(runs, 'goodput'):.2f} "
                      f"/ colocated {Spread.of_runs(base, 'goodput'):.2f}: {spread:.2f}x")  # fmt: skip
                if design.startswith("pd_") and design.endswith(f"@{MAP_LINK}"):
                    cells += 1
                    seeds.append(len(runs))
    body["goodput_vs_colocated"] = ratios
    return {
        f"map cells >= {GOALS['map_cells_min']}": cells >= GOALS["map_cells_min"],
        f"seeds per cell >= {GOALS['seeds_per_cell_min']}": min(seeds, default=0)
        >= GOALS["seeds_per_cell_min"],
    }


def plot(path: Path, body: dict) -> None:
    """Per workload: each split's goodput over colocated's against the load (median, seed range)."""
    plt = pyplot()
    results = body["results"]
    columns = min(2, len(results))
    rows = -(-len(results) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    for axis, (workload, by_load) in zip(axes.flat, results.items(), strict=False):
        loads = list(by_load)
        for design in [*SPLITS, "colocated_8192"]:
            key = f"{design}@{MAP_LINK}"
            spreads = [
                goodput_ratio(by_load[load][key], by_load[load][f"colocated@{MAP_LINK}"]) for load in loads
            ]
            medians = [s.median for s in spreads]
            errors = [
                [m - s.min for m, s in zip(medians, spreads, strict=True)],
                [s.max - m for m, s in zip(medians, spreads, strict=True)],
            ]
            axis.errorbar(loads, medians, yerr=errors, marker="o", capsize=3, label=design)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(f"{workload}: goodput / colocated stall-free's", fontsize=9)
        axis.set_xlabel("load (x colocated's 90%-attainment rate)")
    for axis in axes.flat[len(results) :]:
        axis.set_visible(False)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
