"""Router benchmark: every router over 2 CPU replicas of the real SmolLM2, on the same arrivals,
in one run on one local Ray cluster, at 3 seeds (median and spread reported).

    python -m bench.router [--seeds 0 1 2] [--quick]

Workloads (Poisson arrivals, fixed seeds; SSE streaming; greedy, ignore_eos):
- `chat`: multi-tenant chat (bench/chat_workload.py): 4 tenants, each a ~1,000-token system
  prompt, 3 users per tenant, 3 turns per user resending the conversation. A replica's KV pool
  (192 blocks) holds about three tenants' system prompts, not all four plus their requests.
  Every router: kv_prefix, kv_pressure, Ray's prefix_cache_affinity, power_of_two, round_robin.
- `skewed` (30% long prompts that nearly fill a pool, 70% short) and `uniform`: the earlier
  random-token workloads (no shared prefixes), for kv_prefix against kv_pressure and power_of_two.
Writes bench/results/router_cpu.json and .png."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import chat_workload, http_load, serve_cluster
from bench.http_load import Arrival
from bench.workload import percentile, result_header

CHAT_ROUTERS = ("kv_prefix", "kv_pressure", "prefix_cache_affinity", "power_of_two", "round_robin")
LOAD_ROUTERS = ("kv_prefix", "kv_pressure", "power_of_two")
BLOCK_SIZE = 16
KV_BLOCKS = 192
CHAT = {
    "num_tenants": 4,
    "users_per_tenant": 3,
    "turns": 3,
    "system_tokens": 1000,
    "question_tokens": 50,
    "mean_gap_s": 2.0,
    "mean_think_s": 2.0,
}
CHAT_MAX_TOKENS = 32
LOAD_WORKLOAD = {"num_requests": 20, "mean_gap_s": 3.0}
APP_ARGS = {
    "num_replicas": 2,
    "num_cpus": 0,
    "cpu_threads": 1,
    "engine": {"num_kv_blocks": KV_BLOCKS, "max_model_len": 2048, "max_num_batched_tokens": 256},
}
GOALS = {
    "chat_ttft_p50_vs_prefix_cache_affinity_max": 0.5,
    "chat_ttft_p50_vs_power_of_two_max": 0.3,
    "chat_hit_rate_above_prefix_cache_affinity_and_power_of_two": True,
    "chat_requests_per_replica_max_ratio": 1.5,
    "skewed_ttft_p99_vs_kv_pressure_max": 1.25,  # no regression beyond noise (~+-25% here)
    "uniform_ttft_p99_vs_kv_pressure_max": 1.25,
    "skewed_ttft_p99_vs_power_of_two_max": 0.67,
}
METRIC = "ray_stallfree_"


def load_workload(kind: str, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals, now = [], 0.0
    for _ in range(LOAD_WORKLOAD["num_requests"]):
        now += rng.expovariate(1 / LOAD_WORKLOAD["mean_gap_s"])
        if kind == "skewed":
            prompt_len, max_tokens = (300, 48) if rng.random() < 0.3 else (24, 24)
        else:
            prompt_len, max_tokens = 80, 32
        arrivals.append(Arrival(now, [rng.randrange(100, 49000) for _ in range(prompt_len)], max_tokens))
    return arrivals


@dataclass
class Counters:
    """An app's replica counters (summed over replicas, requests per replica)."""

    hits: float
    queries: float
    preemptions: float
    finished: dict[str, float]

    @classmethod
    def scrape(cls, cluster: serve_cluster.ServeCluster, app: str) -> Counters:
        def total(name: str) -> float:
            return serve_cluster.scrape(cluster, f"{METRIC}{name}", {"application": app})

        finished = serve_cluster.scrape_by_replica(
            cluster, f"{METRIC}requests_finished_total", {"application": app}
        )
        return cls(
            total("prefix_cache_hits_total"),
            total("prefix_cache_queries_total"),
            total("num_preemptions_total"),
            finished,
        )

    def since(self, before: Counters) -> Counters:
        finished = {r: n - before.finished.get(r, 0.0) for r, n in self.finished.items()}
        return Counters(
            self.hits - before.hits,
            self.queries - before.queries,
            self.preemptions - before.preemptions,
            finished,
        )


def run_once(cluster: serve_cluster.ServeCluster, workload: str, router: str, seed: int) -> dict[str, float]:
    url = f"{cluster.base_url}/{router}/v1"
    before = Counters.scrape(cluster, router)
    if workload == "chat":
        conversations = chat_workload.multi_tenant_chat(seed, **CHAT)
        wall, turns = asyncio.run(
            chat_workload.run_conversations(f"{url}/chat/completions", conversations, CHAT_MAX_TOKENS)
        )
        ttft = [t.ttft_s for t in turns]
        intervals = [i for t in turns for i in t.token_intervals_s]
        summary = {
            "wall_s": wall,
            "output_tok_per_s": sum(t.output_tokens for t in turns) / wall,
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p99_s": percentile(ttft, 0.99),
            "tbt_p99_s": percentile(intervals, 0.99),
        }
    else:
        wall, timings = asyncio.run(
            http_load.open_loop(f"{url}/completions", load_workload(workload, seed), salted=False)
        )
        summary = http_load.summarize(wall, timings)
    time.sleep(3)  # replicas report metrics every second
    run = Counters.scrape(cluster, router).since(before)
    served = sorted(run.finished.values(), reverse=True)
    fewest = served[1] if len(served) > 1 else 0.0  # a replica that served none reports none
    return {
        **summary,
        "hit_rate": run.hits / run.queries if run.queries else 0.0,
        "preemptions": run.preemptions,
        "requests_per_replica": served,
        "requests_max_ratio": served[0] / max(fewest, 1.0),
    }


def median_and_spread(runs: list[dict], key: str) -> dict[str, float]:
    values = [run[key] for run in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio(results: dict, workload: str, key: str, ours: str, theirs: str) -> dict[str, float]:
    """Per seed ours/theirs, then median and spread over seeds (paired: same arrivals)."""
    pairs = [a[key] / b[key] for a, b in zip(results[workload][ours], results[workload][theirs], strict=True)]
    return {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs)}


def judge(results: dict) -> tuple[dict[str, dict], dict[str, bool]]:
    ratios = {
        "chat_ttft_p50_vs_prefix_cache_affinity": ratio(
            results, "chat", "ttft_p50_s", "kv_prefix", "prefix_cache_affinity"
        ),
        "chat_ttft_p50_vs_power_of_two": ratio(results, "chat", "ttft_p50_s", "kv_prefix", "power_of_two"),
        "skewed_ttft_p99_vs_kv_pressure": ratio(results, "skewed", "ttft_p99_s", "kv_prefix", "kv_pressure"),
        "uniform_ttft_p99_vs_kv_pressure": ratio(
            results, "uniform", "ttft_p99_s", "kv_prefix", "kv_pressure"
        ),
        "skewed_ttft_p99_vs_power_of_two": ratio(
            results, "skewed", "ttft_p99_s", "kv_prefix", "power_of_two"
        ),
    }
    hit = {router: median_and_spread(runs, "hit_rate")["median"] for router, runs in results["chat"].items()}
    balance = median_and_spread(results["chat"]["kv_prefix"], "requests_max_ratio")["median"]
    met = {
        name: ratios[name.removesuffix("_max")]["median"] <= GOALS[name]
        for name in GOALS
        if name.endswith("_max") and name.removesuffix("_max") in ratios
    }
    met["chat_hit_rate_above_prefix_cache_affinity_and_power_of_two"] = hit["kv_prefix"] > max(
        hit["prefix_cache_affinity"], hit["power_of_two"]
    )
    met["chat_requests_per_replica_max_ratio"] = balance <= GOALS["chat_requests_per_replica_max_ratio"]
    return ratios, met


def print_table(results: dict) -> None:
    columns = (
        ("TTFT p50", 14),
        ("TTFT p99", 14),
        ("tok/s", 7),
        ("hit rate", 8),
        ("preempt", 7),
        ("max/min req", 11),
    )
    header = f"{'workload':<8} {'router':<22} " + " ".join(f"{name:>{width}}" for name, width in columns)
    print(header)
    for workload, by_router in results.items():
        for router, runs in by_router.items():
            p50, p99 = median_and_spread(runs, "ttft_p50_s"), median_and_spread(runs, "ttft_p99_s")
            print(
                f"{workload:<8} {router:<22} {p50['median']:5.2f} [{p50['min']:.2f}-{p50['max']:.2f}] "
                f"{p99['median']:5.2f} [{p99['min']:.2f}-{p99['max']:.2f}] "
                f"{median_and_spread(runs, 'output_tok_per_s')['median']:7.1f} "
                f"{median_and_spread(runs, 'hit_rate')['median']:8.2f} "
                f"{median_and_spread(runs, 'preemptions')['median']:7.0f} "
                f"{median_and_spread(runs, 'requests_max_ratio')['median']:11.2f}"
            )


def plot(path: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft_axis, hit_axis) = plt.subplots(1, 2, figsize=(11, 4))
    chat = results["chat"]
    for router, runs in chat.items():
        medians = [run["ttft_p50_s"] for run in runs]
        ttft_axis.scatter([router] * len(medians), medians, label=None)
        ttft_axis.plot([router], [statistics.median(medians)], "k_", markersize=20)
        hit_axis.bar(router, statistics.median(run["hit_rate"] for run in runs))
    ttft_axis.set_ylabel("TTFT p50 (s), one dot per seed, bar = median")
    hit_axis.set_ylabel("fleet prefix-cache hit rate (median)")
    for axis in (ttft_axis, hit_axis):
        axis.tick_params(axis="x", rotation=30)
    figure.suptitle("multi-tenant chat, 2 CPU replicas of SmolLM2: by router")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="one seed, chat only (a smoke run; no goals)")
    parser.add_argument("--routers", nargs="+", choices=CHAT_ROUTERS, help="with --quick: only these")
    parser.add_argument("--output", type=Path, help="default: bench/results/router_cpu[_quick].json")
    args = parser.parse_args()
    args.output = args.output or Path(f"bench/results/router_cpu{'_quick' if args.quick else ''}.json")
    seeds = args.seeds[:1] if args.quick else args.seeds
    plan = (
        {"chat": tuple(args.routers or CHAT_ROUTERS)}
        if args.quick
        else {"chat": CHAT_ROUTERS, "skewed": LOAD_ROUTERS, "uniform": LOAD_ROUTERS}
    )

    started = time.monotonic()
    work_dir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    deployed = sorted({router for routers in plan.values() for router in routers}, key=CHAT_ROUTERS.index)
    apps = {router: {**APP_ARGS, "request_router": router} for router in deployed}
    cluster = serve_cluster.start(
        serve_cluster.config_with_apps(work_dir / "serve_config.yaml", apps), work_dir
    )
    results: dict[str, dict[str, list[dict]]] = {w: {r: [] for r in routers} for w, routers in plan.items()}
    output = {
        **result_header("router"),
        "seeds": seeds,
        "workloads": {"chat": CHAT, "chat_max_tokens": CHAT_MAX_TOKENS, "skewed_uniform": LOAD_WORKLOAD},
        "replicas": APP_ARGS,
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    try:
        for router in deployed:  # every app must be up, and warm
            cluster.wait_ready(f"/{router}")
            warm = {"prompt": [1000] * 8, "max_tokens": 2}
            serve_cluster.post_concurrently(f"{cluster.base_url}/{router}/v1/completions", warm, 4)
        for seed in seeds:  # seed by seed, so host drift falls on every router alike
            for workload, routers in plan.items():
                for router in routers:
                    summary = run_once(cluster, workload, router, seed)
                    results[workload][router].append({"seed": seed, **summary})
                    print(workload, router, seed, json.dumps(summary), flush=True)
                    args.output.write_text(json.dumps(output, indent=2))  # so far, if the run breaks
    finally:
        serve_cluster.stop(cluster)

    print_table(results)
    output["run_time_s"] = time.monotonic() - started
    if not args.quick:
        ratios, met = judge(results)
        for name, value in ratios.items():
            goal = GOALS[f"{name}_max"]
            verdict = "PASS" if met[f"{name}_max"] else "MISS"
            spread = f"[{value['min']:.2f}-{value['max']:.2f}]"
            print(f"{name}: {value['median']:.2f}x {spread} (goal <= {goal}): {verdict}")
        for name in (
            "chat_hit_rate_above_prefix_cache_affinity_and_power_of_two",
            "chat_requests_per_replica_max_ratio",
        ):
            print(f"{name}: {'PASS' if met[name] else 'MISS'}")
        output.update({"ratios": ratios, "goals": GOALS, "goals_met": met})
    args.output.write_text(json.dumps(output, indent=2))
    print(f"wrote {args.output} in {time.monotonic() - started:.0f} s")
    plot(args.output.with_suffix(".png"), results)


if __name__ == "__main__":
    main()
