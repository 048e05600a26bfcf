"""`python -m bench serve_options`: the Ray-side options of issue 23, re-measured on the engine
core's current shape (issue 36, part 4), each against the shipped serve_config.yaml in the same
run, in paired rounds (shipped, option, shipped, option, ...; the shared host drifts between
minutes, so only ratios taken within a round are compared).

The shipped app runs as `make serve` and harness.serve_cluster run it: behind Ray 2.60's HAProxy
ingress (`RAY_SERVE_ENABLE_HA_PROXY=1`: HTTP straight to the Ingress replica's own server), with
our code and the routers on each replica's own event loop
(`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`, `RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`).
Options: Serve's own Python proxy instead (`RAY_SERVE_ENABLE_HA_PROXY=0`, Serve's default); user
code and router on threads of their own (Serve's default); Ray Serve's throughput-optimized preset
(`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: gRPC between deployments, direct ingress, user code and
router on the main loop, GC frozen at start); gRPC between deployments alone
(`RAY_SERVE_USE_GRPC_BY_DEFAULT=1`); OpenMP's passive wait (`OMP_WAIT_POLICY=PASSIVE`) or a
short spin (`GOMP_SPINCOUNT=10000`: a torch thread spins ~0.15 ms after an op, not ~4 ms); the engine
core in its own process (`engine.core_process: true`); an Ingress deployment in front of an
EngineReplica (`ingress: separate`: a Ray hop per request and per token message; the shipped
one-replica app is colocated, `ingress: auto`).
Every cluster runs with Ray's own report intervals
(harness.serve_cluster.BENCH_CLUSTER_ENV), as a user's does. Each run: bench.serving.cpu_serving's
workload (its first `--requests` requests) at c=1 and c=16, streamed `/v1/completions`, greedy;
the engine alone in this process (core on a thread) on the same requests at c=16 first.

Goal (issue 36): served c=16 tok/s >= 0.9x the engine alone, for the shipped app and for the
best option. An option is a candidate for the default only if it is ahead in every round at c=16
and no worse than 5% at c=1 TBT (printed as `adopt`; this benchmark does not change the config,
and a candidate still has to pass the suite with it)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from bench.driver import Arrival, BenchmarkRun, EngineClient, engine_as_served, engine_sender, print_verdicts
from bench.http_load import Sender, http_sender, run_paced
from bench.serving.cpu_serving import NUM_REQUESTS, shipped_tokenizer, workload
from common.latency import summarize
from harness import serve_cluster
from harness.pacing import closed_loop

SHIPPED = "shipped"
GOALS = {"c16_output_tok_per_s_vs_engine_alone_min": 0.9}
ADOPT_C1_TBT_MAX = 1.05  # an option may cost at most 5% of c=1's time between tokens


@dataclass(frozen=True)
class Option:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    engine: dict = field(default_factory=dict)  # the app's `engine` settings changed
    app: dict = field(default_factory=dict)  # the app's other args changed


OPTIONS = (
    Option("Serve's own proxy", env={"RAY_SERVE_ENABLE_HA_PROXY": "0"}),
    Option("throughput-optimized preset", env={"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}),
    Option("gRPC between deployments", env={"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}),
    Option(
        "user code and router on threads of their own",
        env={"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"},
    ),
    Option("OMP_WAIT_POLICY=PASSIVE", env={"OMP_WAIT_POLICY": "PASSIVE"}),
    Option("GOMP_SPINCOUNT=10000", env={"GOMP_SPINCOUNT": "10000"}),
    Option("core in its own process", engine={"core_process": True}),
    Option("an Ingress in front of an EngineReplica", app={"ingress": "separate"}),
)


def measure(option: Option, arrivals: list[Arrival], work_dir: Path) -> dict[str, dict[str, float]]:
    """c=1 and c=16 against the app as `option` deploys it (the shipped one: no change)."""
    config = serve_cluster.config_with_apps(
        work_dir / "serve_options.yaml", {"stallfree": {"engine": option.engine, **option.app}}
    )
    route = "/stallfree"
    cluster = serve_cluster.start(
        config, work_dir, env=option.env, cluster_env=serve_cluster.BENCH_CLUSTER_ENV
    )
    try:
        cluster.wait_ready(route)
        figures = closed_loops(http_sender(f"{cluster.base_url}{route}/v1/completions"), arrivals, (1, 16))
        print(option.name, json.dumps(figures), flush=True)
        return figures
    finally:
        serve_cluster.stop(cluster)


def closed_loops(sender: Sender, arrivals: list[Arrival], concurrencies: tuple[int, ...]) -> dict[str, dict]:
    """Warm, then a closed loop at each concurrency: its latency summary, by `c<concurrency>`."""
    run_paced(sender, partial(closed_loop, items=arrivals[:4], concurrency=4))  # kernels, first steps
    return {
        f"c{concurrency}": summarize(
            *run_paced(sender, partial(closed_loop, items=arrivals, concurrency=concurrency))
        )
        for concurrency in concurrencies
    }


def engine_alone_c16(arrivals: list[Arrival]) -> float:
    """The same requests at c=16 straight into an engine in this process, its core on a thread."""
    client = EngineClient(engine_as_served({"core_process": False}))
    try:
        return closed_loops(engine_sender(client), arrivals, (16,))["c16"]["output_tok_per_s"]
    finally:
        client.engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="paired rounds (shipped, option) per option")
    parser.add_argument(
        "--requests", type=int, default=16, help=f"of the {NUM_REQUESTS} of bench.serving.cpu_serving"
    )
    parser.add_argument(
        "--options", default=",".join(o.name for o in OPTIONS), help="which options, by name, comma-separated"
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/serve_options.json"))
    args = parser.parse_args(argv)
    chosen = args.options.split(",")
    unknown = set(chosen) - {o.name for o in OPTIONS}
    if unknown:
        parser.error(f"--options: unknown {sorted(unknown)}")
    run = BenchmarkRun("serve_options", args.output, GOALS)
    arrivals = workload(0, shipped_tokenizer())[: args.requests]
    alone = engine_alone_c16(arrivals)  # first: before Ray, see ThreadCore
    work_dir = Path(tempfile.mkdtemp(prefix="bench-serve-options-"))
    rounds: dict[str, list[dict]] = {}
    for option in (o for o in OPTIONS if o.name in chosen):
        for _ in range(args.rounds):
            rounds.setdefault(option.name, []).append(
                {
                    SHIPPED: measure(Option(SHIPPED), arrivals, work_dir),
                    option.name: measure(option, arrivals, work_dir),
                }
            )
    summary = {name: _paired(name, paired) for name, paired in rounds.items()}
    shipped_c16 = statistics.median(
        r[SHIPPED]["c16"]["output_tok_per_s"] for paired in rounds.values() for r in paired
    )
    best = max(summary, key=lambda name: summary[name]["c16_tok_per_s_ratio_median"], default=None)
    best_c16 = shipped_c16 * summary[best]["c16_tok_per_s_ratio_median"] if best else shipped_c16
    print(f"\nengine alone c=16: {alone:.1f} tok/s; shipped (median of its runs): {shipped_c16:.1f}")
    print(f"{'option':32}{'c16 tok/s':>11}{'c1 TBT p50':>12}{'c16 TTFT p50':>14}{'c16 TBT p99':>13}  adopt")
    for name, s in summary.items():
        print(
            f"{name:32}{s['c16_tok_per_s_ratio_median']:>10.2f}x{s['c1_tbt_p50_ratio_median']:>11.2f}x"
            f"{s['c16_ttft_p50_ratio_median']:>13.2f}x{s['c16_tbt_p99_ratio_median']:>12.2f}x  "
            f"{'yes' if s['adopt'] else 'no'}"
        )
    least = GOALS["c16_output_tok_per_s_vs_engine_alone_min"]
    met = {
        f"shipped: served c16 >= {least}x the engine alone": shipped_c16 / alone >= least,
        f"best option ({best}): served c16 >= {least}x the engine alone": best_c16 / alone >= least,
    }
    print_verdicts(met)
    body = {
        "workload": {"requests": args.requests, "rounds": args.rounds, "concurrency": [1, 16]},
        "options": {
            o.name: {"env": o.env, "engine": o.engine, "measured": o.name in rounds} for o in OPTIONS
        },
        "engine_alone_c16_output_tok_per_s": alone,
        "shipped_c16_output_tok_per_s_median": shipped_c16,
        "shipped_c16_over_engine_alone": shipped_c16 / alone,
        "best_option": best,
        "best_c16_over_engine_alone": best_c16 / alone,
        "option_over_shipped": summary,
        "rounds": rounds,
    }
    run.write(body, met)


def _paired(name: str, paired: list[dict]) -> dict:
    """The option over the shipped app, per round, then the median; and whether it earns the default."""

    def ratios(run: str, key: str) -> list[float]:
        return [r[name][run][key] / r[SHIPPED][run][key] for r in paired]

    c16 = ratios("c16", "output_tok_per_s")
    c1_tbt = ratios("c1", "tbt_p50_s")
    return {
        "c16_tok_per_s_ratios": c16,
        "c16_tok_per_s_ratio_median": statistics.median(c16),
        "c1_tbt_p50_ratio_median": statistics.median(c1_tbt),
        "c16_ttft_p50_ratio_median": statistics.median(ratios("c16", "ttft_p50_s")),
        "c16_tbt_p99_ratio_median": statistics.median(ratios("c16", "tbt_p99_s")),
        "adopt": min(c16) > 1.0 and statistics.median(c1_tbt) <= ADOPT_C1_TBT_MAX,
    }


if __name__ == "__main__":
    main()
