"""python -m bench capacity_seeds: bench.engine.capacity's capacities on two more arrival seeds.

A full bisection per seed would triple bench.engine.capacity's run time, so each system's capacity
found on seed 0 (c, a point of the 2^(1/4) grid) is bracketed on seeds 1 and 2: the same
requests' lengths and gaps drawn from the new seed, replayed at c and at the next grid point up.
Passing at c and failing above gives c; passing both, at least the point above (counted as it);
failing at c, less than c (counted as the point below). Capacity per system = the median of the
three seeds, with their spread; the goals are judged on the medians. Same SLOs and delay bound
as seed 0 (the same machine, measured by bench.engine.capacity). Reads and extends
bench/results/capacity_cpu.json."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.driver import Spread, print_verdicts, write_result
from bench.engine.capacity import ADAPTIVE, COMMON, FIXED, MAX_RATE, Replay, meets, print_table, summarize
from bench.engine.capacity_run import System, workload

GRID_STEP = 2 ** (1 / 4)  # bench.engine.capacity's two bisection steps between doubling rates
SEEDS = (1, 2)


def bracket(system: System, replay: Replay, capacity: float, slo: float, delay_bound_s: float) -> float:
    """This seed's capacity near seed 0's `capacity`, on its grid."""
    passed_at = meets(system.run(replay.at(capacity), capacity), slo, delay_bound_s)
    if not passed_at:
        return capacity / GRID_STEP
    above = capacity * GRID_STEP
    if above > MAX_RATE * 1.001:
        return capacity
    return above if meets(system.run(replay.at(above), above), slo, delay_bound_s) else capacity


def seed_capacities(seed: int, result: dict) -> dict[str, dict[str, float]]:
    slos, delay_bound_s = result["slos_s"], result["scheduling_delay_bound_s"]
    window_s, min_requests = result["arrival_window_s"], result["min_requests_per_point"]
    replay = Replay(workload(max(min_requests, round(MAX_RATE * window_s)), seed), window_s, min_requests)
    seed_zero = result["capacity_req_per_s"]
    found: dict[str, dict[str, float]] = {}
    systems = {name: (settings, list(slos)) for name, settings in FIXED.items()}
    systems |= {f"adaptive ({slo})": ({**ADAPTIVE, "tbt_slo_s": slos[slo]}, [slo]) for slo in slos}
    for name, (settings, judged_by) in systems.items():
        system = System({**COMMON, **settings})
        try:
            for slo in judged_by:
                key = "adaptive" if name.startswith("adaptive") else name
                capacity = bracket(system, replay, seed_zero[key][slo], slos[slo], delay_bound_s)
                found.setdefault(key, {})[slo] = capacity
                print(f"seed {seed}, {name}, {slo}: {capacity:.3f} req/s", flush=True)
        finally:
            system.shutdown()
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--result", type=Path, default=Path("bench/results/capacity_cpu.json"))
    args = parser.parse_args(argv)
    started = time.monotonic()
    result = json.loads(args.result.read_text())
    per_seed = {0: result["capacity_req_per_s"]} | {seed: seed_capacities(seed, result) for seed in SEEDS}
    over_seeds = {
        system: {slo: Spread.of(per_seed[seed][system][slo] for seed in per_seed) for slo in caps}
        for system, caps in result["capacity_req_per_s"].items()
    }
    median = {system: {slo: s.median for slo, s in caps.items()} for system, caps in over_seeds.items()}
    spread = {system: {slo: s.range for slo, s in caps.items()} for system, caps in over_seeds.items()}
    summary, met = summarize(median)
    print("median of 3 seeds:")
    print_table(median, summary, result["slos_s"])
    met["adaptive_holds_strict_on_1_thread"] = result["goals_met"]["adaptive_holds_strict_on_1_thread"]
    print_verdicts(met)
    result |= {
        "seed_check": {"method": __doc__, "per_seed": {str(s): c for s, c in per_seed.items()}},
        "capacity_median_req_per_s": median,
        "capacity_spread_req_per_s": spread,
        "summary_median": summary,
        "goals_met_seed_0": result.get("goals_met_seed_0", result["goals_met"]),
        "goals_met": met,  # on the medians of 3 seeds (the 1-vs-2-thread goal: seed 0's comparison)
        "run_s": round(result["run_s"] + time.monotonic() - started, 1),
    }
    write_result(args.result, result)


if __name__ == "__main__":
    main()
