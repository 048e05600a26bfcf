"""python -m bench capacity [--quick]: the scheduler's claim, measured on this CPU.

Capacity (Sarathi-Serve's definition): the highest Poisson request rate at which P99 time
between tokens (TBT) <= the SLO and the median scheduling delay (arrival -> first scheduled)
<= a bound. Real SmolLM2 in one process (AsyncEngine, no Ray: the engine is what is measured),
serve_config's engine settings (dtype auto) with prefix caching off (random prompts share
nothing; replayed points must not find each other's prompts).

Workload: random-token prompts log-uniform 64-1024, outputs uniform 16-128 (ignore_eos),
exponential gaps; one fixed seed, the same requests at every rate (gaps scaled by 1/rate) and
for every system. A point replays as many of them as arrive in a 32 s window at its rate, and at
least 48 (~3,500 TBT samples): at a rate past what the engine sustains the queue then grows
long enough for the delay bound to see it (a fixed 64 requests ended before it could).

SLOs, derived on this machine at start and scale-free like Sarathi's: d = the median
decode-only step at batch 8 (512-token prompts); strict P99 TBT <= 5 d, relaxed <= 25 d. The
scheduling-delay bound is 80 d for both: Sarathi's 2 s over its ~25 ms decode steps.

Systems: prefill_first (whole prompts, budget 2048); stall_free with fixed budgets 128, 512,
2048; adaptive = stall_free with tbt_slo_s set to the SLO under test (budget cap 2048).

Search: rates doubling from 0.5 req/s until every SLO a system is judged by fails, then
bisection (geometric) between the highest pass and the lowest fail. Capacity = the highest
rate that passed (0 when even the lowest failed).

Seeds 1 and 2 (median and spread): python -m bench capacity_seeds, after this.

Same target, different hardware: at one rate, the fixed budget best under the strict SLO on 2
threads and the adaptive budget (strict target), each on 1 and on 2 torch threads."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from bench.driver import Arrival, BenchmarkRun, print_verdicts, pyplot
from bench.engine.capacity_run import System, decode_step_s, workload

FIXED = {
    "prefill_first": {"scheduling_policy": "prefill_first", "max_num_batched_tokens": 2048},
    "stall_free 128": {"max_num_batched_tokens": 128},
    "stall_free 512": {"max_num_batched_tokens": 512},
    "stall_free 2048": {"max_num_batched_tokens": 2048},
}
ADAPTIVE = {"max_num_batched_tokens": 2048}  # + tbt_slo_s
COMMON = {"enable_prefix_caching": False}
SLO_FACTORS = {"strict": 5, "relaxed": 25}
DELAY_FACTOR = 80
FIRST_RATE, MAX_RATE = 0.5, 8.0
SEED = 0
GOALS = {
    "stall_free_2x_prefill_first_strict": "best fixed stall_free budget >= 2x prefill_first, strict SLO",
    "adaptive_0.95x_best_fixed_strict": "adaptive >= 0.95x the best fixed budget, strict SLO",
    "adaptive_0.95x_best_fixed_relaxed": "adaptive >= 0.95x the best fixed budget, relaxed SLO",
    "adaptive_beats_every_fixed_on_both": "one setting for both SLOs: adaptive's worse ratio to the"
    " best fixed budget > every fixed budget's",
    "adaptive_holds_strict_on_1_thread": "on 1 thread, adaptive's P99 TBT <= the strict SLO where the fixed"
    " budget chosen on 2 threads exceeds it",
}


def meets(point: dict, tbt_slo_s: float, delay_bound_s: float) -> bool:
    return point["tbt_p99_s"] <= tbt_slo_s and point["scheduling_delay_p50_s"] <= delay_bound_s


@dataclass(frozen=True)
class Replay:
    arrivals: list[Arrival]  # enough for the highest rate
    window_s: float
    min_requests: int

    def at(self, rate: float) -> list[Arrival]:
        return self.arrivals[: max(self.min_requests, round(rate * self.window_s))]


def search(
    system: System, replay: Replay, slos: dict[str, float], delay_bound_s: float, steps: int
) -> tuple[dict[str, float], list[dict]]:
    """Capacity under each SLO in `slos`; every point measured (a rate is run once)."""
    points: dict[float, dict] = {}

    def at(rate: float) -> dict:
        if rate not in points:
            points[rate] = system.run(replay.at(rate), rate)
            p = points[rate]
            print(
                f"  {rate:6.3f} req/s ({p['requests']} requests): TBT p99 {p['tbt_p99_s']:.3f} s,"
                f" delay p50 {p['scheduling_delay_p50_s']:.2f} s,"
                f" {p['output_tok_per_s']:.0f} tok/s, {p['wall_s']:.0f} s",
                flush=True,
            )
        return points[rate]

    rate = FIRST_RATE
    while rate <= MAX_RATE and any(meets(at(rate), slo, delay_bound_s) for slo in slos.values()):
        rate *= 2
    capacities = {}
    for name, slo in slos.items():
        passed = [r for r, p in points.items() if meets(p, slo, delay_bound_s)]
        failed = [r for r, p in points.items() if not meets(p, slo, delay_bound_s)]
        low = max(passed, default=0.0)
        high = min((r for r in failed if r > low), default=None)
        for _ in range(steps if low and high else 0):
            middle = math.sqrt(low * high)
            if meets(at(middle), slo, delay_bound_s):
                low = middle
            else:
                high = middle
        capacities[name] = low
    return capacities, [points[r] for r in sorted(points)]


def thread_comparison(replay: Replay, fixed_settings: dict, strict_s: float, rate: float) -> dict:
    """P99 TBT of one fixed budget and of the adaptive one on 1 and 2 torch threads, same target."""
    results: dict = {}
    for threads in (1, 2):
        for name, settings in (("fixed", fixed_settings), ("adaptive", {**ADAPTIVE, "tbt_slo_s": strict_s})):
            system = System({**COMMON, **settings}, num_threads=threads)
            try:
                results[f"{name}, {threads} thread{'s' if threads > 1 else ''}"] = system.run(
                    replay.at(rate), rate
                )
            finally:
                system.shutdown()
    return results


def plot(path: Path, curves: dict[str, list[dict]], slos: dict[str, float], delay_bound_s: float) -> None:
    plt = pyplot()
    figure, (tbt_axis, delay_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, points in curves.items():
        rates = [p["rate"] for p in points]
        tbt_axis.plot(rates, [p["tbt_p99_s"] for p in points], marker="o", label=system)
        delay_axis.plot(rates, [p["scheduling_delay_p50_s"] for p in points], marker="o", label=system)
    for name, slo in slos.items():
        tbt_axis.axhline(slo, linestyle=":", color="grey")
        tbt_axis.text(FIRST_RATE, slo, f" {name} SLO", fontsize=7, va="bottom")
    delay_axis.axhline(delay_bound_s, linestyle=":", color="grey")
    for axis, label in ((tbt_axis, "P99 TBT (s)"), (delay_axis, "median scheduling delay (s)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("request rate (req/s)")
        axis.set_ylabel(label)
        axis.legend(fontsize=7)
    figure.suptitle("SmolLM2 on this CPU: capacity = highest rate under both lines")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def summarize(capacities: dict[str, dict[str, float]]) -> tuple[dict, dict[str, bool]]:
    fixed_sf = [s for s in FIXED if s.startswith("stall_free")]
    best = {slo: max(capacities[s][slo] for s in fixed_sf) for slo in SLO_FACTORS}
    ratios = {
        s: {slo: capacities[s][slo] / best[slo] if best[slo] else math.nan for slo in SLO_FACTORS}
        for s in [*FIXED, "adaptive"]
    }
    worst = {s: min(r.values()) for s, r in ratios.items()}
    prefill_first = capacities["prefill_first"]["strict"]
    met = {
        "stall_free_2x_prefill_first_strict": best["strict"] >= 2 * prefill_first and best["strict"] > 0,
        "adaptive_0.95x_best_fixed_strict": ratios["adaptive"]["strict"] >= 0.95,
        "adaptive_0.95x_best_fixed_relaxed": ratios["adaptive"]["relaxed"] >= 0.95,
        "adaptive_beats_every_fixed_on_both": all(worst["adaptive"] > worst[s] for s in FIXED),
    }
    return {"best_fixed": best, "ratio_to_best_fixed": ratios, "worse_ratio": worst}, met


def _rate(capacity: float) -> str:
    """A capacity at the sweep's ceiling is a lower bound."""
    return f">= {capacity:.3f}" if capacity >= MAX_RATE else f"{capacity:.3f}"


def print_table(capacities: dict, summary: dict, slos: dict[str, float]) -> None:
    print(
        f"\n| system | strict ({slos['strict'] * 1000:.0f} ms) req/s"
        f" | relaxed ({slos['relaxed'] * 1000:.0f} ms)"
        " req/s | worse ratio to best fixed |"
    )
    print("|---|---|---|---|")
    for system, capacity in capacities.items():
        print(
            f"| {system} | {_rate(capacity['strict'])} | {_rate(capacity['relaxed'])} |"
            f" {summary['worse_ratio'][system]:.2f} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~10 minutes: 12 s windows, one bisection step")
    parser.add_argument("--output", type=Path, default=Path("bench/results/capacity_cpu.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("capacity", args.output, GOALS)
    window_s, min_requests, steps = (12.0, 16, 1) if args.quick else (32.0, 48, 2)
    replay = Replay(workload(max(min_requests, round(MAX_RATE * window_s)), SEED), window_s, min_requests)
    decode_s = decode_step_s()
    slos = {name: factor * decode_s for name, factor in SLO_FACTORS.items()}
    delay_bound_s = DELAY_FACTOR * decode_s
    print(
        f"decode step at batch 8: {decode_s * 1000:.1f} ms -> strict {slos['strict']:.3f} s,"
        f" relaxed {slos['relaxed']:.3f} s, scheduling delay bound {delay_bound_s:.2f} s;"
        f" {window_s:.0f} s of arrivals a point, at least {min_requests} requests"
    )
    capacities: dict[str, dict[str, float]] = {}
    curves: dict[str, list[dict]] = {}
    for name, settings in FIXED.items():
        print(name, flush=True)
        system = System({**COMMON, **settings})
        try:
            capacities[name], curves[name] = search(system, replay, slos, delay_bound_s, steps)
        finally:
            system.shutdown()
    capacities["adaptive"] = {}
    for slo_name, slo in slos.items():
        print(f"adaptive, tbt_slo_s {slo:.3f} ({slo_name})", flush=True)
        system = System({**COMMON, **ADAPTIVE, "tbt_slo_s": slo})
        try:
            found, curves[f"adaptive ({slo_name})"] = search(
                system, replay, {slo_name: slo}, delay_bound_s, steps
            )
        finally:
            system.shutdown()
        capacities["adaptive"][slo_name] = found[slo_name]
    summary, met = summarize(capacities)
    print_table(capacities, summary, slos)
    best_strict = max((s for s in FIXED if s.startswith("stall_free")), key=lambda s: capacities[s]["strict"])
    threads_rate = max(FIRST_RATE, capacities[best_strict]["strict"] / 2)
    print(
        f"1 vs 2 threads at {threads_rate:.3f} req/s: fixed = {best_strict},"
        f" adaptive target {slos['strict']:.3f} s"
    )
    threads = thread_comparison(replay, FIXED[best_strict], slos["strict"], threads_rate)
    for name, point in threads.items():
        print(f"  {name}: TBT p99 {point['tbt_p99_s']:.3f} s, {point['output_tok_per_s']:.0f} tok/s")
    met["adaptive_holds_strict_on_1_thread"] = (
        threads["adaptive, 1 thread"]["tbt_p99_s"] <= slos["strict"] < threads["fixed, 1 thread"]["tbt_p99_s"]
    )
    print_verdicts(met)
    run.write({
        "method": __doc__,
        "quick": args.quick,
        "arrival_window_s": window_s,
        "min_requests_per_point": min_requests,
        "decode_step_batch8_s": decode_s,
        "slos_s": slos,
        "scheduling_delay_bound_s": delay_bound_s,
        "capacity_req_per_s": capacities,
        "summary": summary,
        "points": curves,
        "threads": {
            "rate": threads_rate, "fixed": best_strict, "target_s": slos["strict"], "points": threads
        },
    }, met)  # fmt: skip
    plot(args.output.with_suffix(".png"), curves, slos, delay_bound_s)


if __name__ == "__main__":
    main()
