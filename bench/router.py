"""Router benchmark: the same workloads over 2 replicas with our KV-pressure router, Serve's
power-of-two router and round robin, in one run on one local Ray cluster.

    python -m bench.router [--num-requests 30] [--mean-gap-s 3] [--seed 0]

Two workloads, each with Poisson arrivals at a fixed seed and random-token prompts (no shared
prefixes): `skewed` (30% long prompts that nearly fill a replica's KV pool, 70% short) and
`uniform` (all requests alike: load-only routing is expected to tie with blind routing there).
Latencies are what an HTTP client sees over SSE. Writes bench/results/router_cpu.json and .png."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench import http_load, serve_cluster
from bench.http_load import Arrival, StreamTiming
from bench.workload import result_header

ROUTERS = ("kv_pressure", "power_of_two", "round_robin")
BLOCK_SIZE = 16
KV_BLOCKS = 40  # per replica: one long request takes 22, two on one replica must preempt
GOALS = {"ttft_p99_ratio_max": 0.67}  # vs power of two, with fewer preemptions
APP_ARGS = {
    "num_replicas": 2,
    "num_cpus": 0,
    "cpu_threads": 1,
    "engine": {
        "num_kv_blocks": KV_BLOCKS,
        "max_model_len": KV_BLOCKS * BLOCK_SIZE,
        "max_num_batched_tokens": 256,
    },
}


def workload(kind: str, num_requests: int, seed: int, mean_gap_s: float) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(1 / mean_gap_s)
        if kind == "skewed":
            prompt_len, max_tokens = (300, 48) if rng.random() < 0.3 else (24, 24)
        else:
            prompt_len, max_tokens = 80, 32
        arrivals.append(Arrival(now, [rng.randrange(100, 49000) for _ in range(prompt_len)], max_tokens))
    return arrivals


def summarize(wall_s: float, timings: list[StreamTiming], preemptions: float) -> dict[str, float]:
    return {**http_load.summarize(wall_s, timings), "preemptions": preemptions}


def _plot(path: Path, timings: dict[str, list[StreamTiming]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, records in timings.items():
        ttft = sorted(t.ttft_s for t in records)
        axis.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
    axis.set_xlabel("time to first token (s)")
    axis.set_ylabel("fraction of requests")
    axis.set_title("skewed workload, 2 CPU replicas: TTFT CDF by router")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mean-gap-s", type=float, default=3.0, help="mean time between arrivals")
    parser.add_argument("--output", type=Path, default=Path("bench/results/router_cpu.json"))
    args = parser.parse_args()

    work_dir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    cluster = serve_cluster.start(
        serve_cluster.config_with_apps(
            work_dir / "serve_config.yaml", {r: {**APP_ARGS, "request_router": r} for r in ROUTERS}
        ),
        work_dir,
    )
    summaries: dict[str, dict[str, dict[str, float]]] = {}
    skewed_timings: dict[str, list[StreamTiming]] = {}
    try:
        for router in ROUTERS:  # every app must be up, and warm
            cluster.wait_ready(f"/{router}")
            warm = {"prompt": [1000] * 8, "max_tokens": 2}
            serve_cluster.post_concurrently(f"{cluster.base_url}/{router}/v1/completions", warm, 4)
        for kind in ("skewed", "uniform"):
            arrivals = workload(kind, args.num_requests, args.seed, args.mean_gap_s)
            summaries[kind] = {}
            for router in ROUTERS:
                labels = {"application": router}
                before = serve_cluster.scrape(cluster, "ray_stallfree_num_preemptions_total", labels)
                url = f"{cluster.base_url}/{router}/v1/completions"
                wall, timings = asyncio.run(http_load.open_loop(url, arrivals))
                time.sleep(3)  # replicas report metrics every second
                preemptions = (
                    serve_cluster.scrape(cluster, "ray_stallfree_num_preemptions_total", labels) - before
                )
                summaries[kind][router] = summarize(wall, timings, preemptions)
                if kind == "skewed":
                    skewed_timings[router] = timings
                print(kind, router, json.dumps(summaries[kind][router]), flush=True)
    finally:
        serve_cluster.stop(cluster)

    columns = ("tok/s", 7), ("TTFT p50", 9), ("TTFT p99", 9), ("TBT p99", 8), ("preempt", 8)
    print(f"{'workload':<8} {'router':<13} " + " ".join(f"{name:>{width}}" for name, width in columns))
    for kind, rows in summaries.items():
        for router, s in rows.items():
            print(
                f"{kind:<8} {router:<13} {s['output_tok_per_s']:7.2f} {s['ttft_p50_s']:9.2f} "
                f"{s['ttft_p99_s']:9.2f} {s['tbt_p99_s']:8.3f} {s['preemptions']:8.0f}"
            )
    ours, baseline = summaries["skewed"]["kv_pressure"], summaries["skewed"]["power_of_two"]
    ratio = ours["ttft_p99_s"] / baseline["ttft_p99_s"]
    met = ratio <= GOALS["ttft_p99_ratio_max"] and ours["preemptions"] < baseline["preemptions"]
    print(
        f"skewed: p99 TTFT vs power of two {ratio:.2f}x (goal <= 0.67), preemptions "
        f"{ours['preemptions']:.0f} vs {baseline['preemptions']:.0f}: {'PASS' if met else 'MISS'}"
    )

    args.output.parent.mkdir(parents=True, exist_ok=True)
    result = {
        **result_header("router"),
        "workload": {
            "num_requests": args.num_requests,
            "seed": args.seed,
            "mean_gap_s": args.mean_gap_s,
            "skewed": "30% prompt 300 / output 48 tokens, 70% prompt 24 / output 24",
            "uniform": "prompt 80 / output 32 tokens",
            "prompts": "random token ids (no shared prefixes); ignore_eos; SSE streaming",
        },
        "replicas": APP_ARGS,
        "summaries": summaries,
        "skewed_ttft_p99_ratio_vs_power_of_two": ratio,
        "goals": GOALS,
        "goal_met": met,
        "requests": {router: [asdict(t) for t in timings] for router, timings in skewed_timings.items()},
    }
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")
    _plot(args.output.with_suffix(".png"), skewed_timings)


if __name__ == "__main__":
    main()
