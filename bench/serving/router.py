"""Router benchmark: every router over 2 CPU replicas of the real SmolLM2, on the same arrivals,
in one run on one local Ray cluster, at 3 seeds (median and spread reported).

    python -m bench router [--seeds 0 1 2] [--quick]

Workloads (Poisson arrivals, fixed seeds; SSE streaming; greedy, ignore_eos):
- `chat`: multi-tenant chat (bench/chat_workload.py): 4 tenants, each a ~1,000-token system
  prompt, 3 users per tenant, 3 turns per user resending the conversation. A replica's KV pool
  (192 blocks) holds about three tenants' system prompts, not all four plus their requests.
  Every router: kv_prefix, kv_pressure, Ray's prefix_cache_affinity, power_of_two, round_robin.
- `eviction`: the chat workload with 10 tenants whose users follow Zipf popularity (s 1.1), so
  the two pools (about three system prompts each) must evict, and the replica with the most
  running requests killed (ray.kill, as a crash) when half the conversations have started: its
  streams fail and end their conversations, Serve starts a replacement with an empty cache.
  Every router; the next run waits until the replacement serves.
- `skewed` (30% long prompts that nearly fill a pool, 70% short) and `uniform`: the earlier
  random-token workloads (no shared prefixes), for kv_prefix against kv_pressure and power_of_two.
Writes bench/results/router_cpu.json and .png."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench import chat_workload, http_load
from bench.driver import Arrival, BenchmarkRun, Spread, print_verdicts, pyplot
from common.latency import summarize
from harness import serve_cluster
from harness.metrics_scrape import EngineCounters
from harness.random_workload import random_tokens
from harness.replicas import kill_replica, wait_replaced

CHAT_ROUTERS = ("kv_prefix", "kv_pressure", "prefix_cache_affinity", "power_of_two", "round_robin")
LOAD_ROUTERS = ("kv_prefix", "kv_pressure", "power_of_two")
WORKLOADS = {"chat": CHAT_ROUTERS, "eviction": CHAT_ROUTERS, "skewed": LOAD_ROUTERS, "uniform": LOAD_ROUTERS}
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
EVICTION = {**CHAT, "num_tenants": 10, "users_per_tenant": 2, "mean_gap_s": 1.5, "zipf_s": 1.1}
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
    "eviction_ttft_p50_vs_prefix_cache_affinity_max": 0.5,
    "eviction_hit_rate_above_prefix_cache_affinity": True,
    "skewed_ttft_p99_vs_kv_pressure_max": 1.25,  # no regression beyond noise (~+-25% here)
    "uniform_ttft_p99_vs_kv_pressure_max": 1.25,
    "skewed_ttft_p99_vs_power_of_two_max": 0.67,
}


def load_workload(kind: str, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals, now = [], 0.0
    for _ in range(LOAD_WORKLOAD["num_requests"]):
        now += rng.expovariate(1 / LOAD_WORKLOAD["mean_gap_s"])
        if kind == "skewed":
            prompt_len, max_tokens = (300, 48) if rng.random() < 0.3 else (24, 24)
        else:
            prompt_len, max_tokens = 80, 32
        arrivals.append(Arrival(now, random_tokens(rng, prompt_len, (100, 49000)), max_tokens))
    return arrivals


def run_once(cluster: serve_cluster.ServeCluster, workload: str, router: str, seed: int) -> dict[str, float]:
    url = f"{cluster.base_url}/{router}/v1"
    before = EngineCounters.scrape(cluster, router)
    if workload in ("chat", "eviction"):
        summary = run_chat(cluster, workload, router, seed)
    else:
        wall, timings = asyncio.run(
            http_load.open_loop(f"{url}/completions", load_workload(workload, seed), salted=False)
        )
        summary = summarize(wall, timings)
    time.sleep(3)  # replicas report metrics every second
    run = EngineCounters.scrape(cluster, router).since(before)
    served = sorted(run.finished_by_replica.values(), reverse=True)
    fewest = served[1] if len(served) > 1 else 0.0  # a replica that served none reports none
    return {
        "hit_rate": run.hit_rate,
        **summary,  # its own hit rate where a killed replica's counters went with it
        "preemptions": run.preemptions,
        "requests_per_replica": served,
        "requests_max_ratio": served[0] / max(fewest, 1.0),
    }


def run_chat(cluster: serve_cluster.ServeCluster, workload: str, router: str, seed: int) -> dict:
    url = f"{cluster.base_url}/{router}/v1/chat/completions"
    if workload == "chat":
        conversations = chat_workload.multi_tenant_chat(seed, **CHAT)
        wall, turns = asyncio.run(chat_workload.run_conversations(url, conversations, CHAT_MAX_TOKENS))
        return summarize(wall, [turn.timing for turn in turns if turn.timing is not None])
    conversations = chat_workload.multi_tenant_chat(seed, **EVICTION)
    kill_at_s = conversations[len(conversations) // 2].at_s
    killed: list[str] = []

    async def serve_and_kill() -> tuple[float, list[chat_workload.Turn]]:
        async def kill() -> None:
            await asyncio.sleep(kill_at_s)
            killed.append(await asyncio.to_thread(kill_replica, cluster, router))

        killer = asyncio.create_task(kill())
        served = await chat_workload.run_conversations(url, conversations, CHAT_MAX_TOKENS, True)
        await killer
        return served

    wall, turns = asyncio.run(serve_and_kill())
    replaced_s = wait_replaced(router, killed[0], APP_ARGS["num_replicas"])
    warm_up(cluster, router)  # the replacement too
    served = [turn for turn in turns if turn.timing is not None]
    timings = [turn.timing for turn in served if turn.timing is not None]
    return summarize(wall, timings) | {
        # as the clients saw it (usage.prompt_tokens_details.cached_tokens), completed turns only
        "hit_rate": sum(turn.cached_tokens for turn in served) / sum(t.prompt_len for t in timings),
        "failed_turns": len(turns) - len(timings),
        "killed_at_s": kill_at_s,
        "replaced_after_s": replaced_s,  # waited after the run's end: the replacement came up during it
    }


def warm_up(cluster: serve_cluster.ServeCluster, router: str) -> None:
    warm = {"prompt": [1000] * 8, "max_tokens": 2}
    serve_cluster.post_concurrently(f"{cluster.base_url}/{router}/v1/completions", warm, 4)


def ratio(results: dict, workload: str, key: str, ours: str, theirs: str) -> Spread:
    """Per seed ours/theirs, then median and spread over seeds (paired: same arrivals)."""
    return Spread.of_ratios(results[workload][ours], results[workload][theirs], key)


def judge(results: dict) -> tuple[dict[str, Spread], dict[str, bool]]:
    """The goals of the workloads that ran."""
    ratios, met = {}, {}
    if "chat" in results:
        ratios, met = judge_chat(results)
    if "eviction" in results:
        name = "eviction_ttft_p50_vs_prefix_cache_affinity"
        ratios[name] = ratio(results, "eviction", "ttft_p50_s", "kv_prefix", "prefix_cache_affinity")
        met[f"{name}_max"] = ratios[name].median <= GOALS[f"{name}_max"]
        hit = {r: Spread.of_runs(runs, "hit_rate").median for r, runs in results["eviction"].items()}
        met["eviction_hit_rate_above_prefix_cache_affinity"] = hit["kv_prefix"] > hit["prefix_cache_affinity"]
    return ratios, met


def judge_chat(results: dict) -> tuple[dict[str, Spread], dict[str, bool]]:
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
    hit = {router: Spread.of_runs(runs, "hit_rate").median for router, runs in results["chat"].items()}
    balance = Spread.of_runs(results["chat"]["kv_prefix"], "requests_max_ratio").median
    met = {
        name: ratios[name.removesuffix("_max")].median <= GOALS[name]
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
            p50, p99 = Spread.of_runs(runs, "ttft_p50_s"), Spread.of_runs(runs, "ttft_p99_s")
            medians = (
                f"{Spread.of_runs(runs, key).median:{spec}}"
                for key, spec in (("output_tok_per_s", "7.1f"), ("hit_rate", "8.2f"),
                                  ("preemptions", "7.0f"), ("requests_max_ratio", "11.2f"))
            )  # fmt: skip
            print(f"{workload:<8} {router:<22} {p50:5.2f} {p99:5.2f} {' '.join(medians)}")


def plot(path: Path, results: dict) -> None:
    """Per conversational workload that ran (chat, eviction): TTFT p50 and hit rate by router."""
    plt = pyplot()
    shown = [w for w in ("chat", "eviction") if w in results]
    figure, axes = plt.subplots(len(shown), 2, figsize=(11, 4 * len(shown)), squeeze=False)
    for workload, (ttft_axis, hit_axis) in zip(shown, axes, strict=True):
        for router, runs in results[workload].items():
            medians = [run["ttft_p50_s"] for run in runs]
            ttft_axis.scatter([router] * len(medians), medians, label=None)
            ttft_axis.plot([router], [Spread.of(medians).median], "k_", markersize=20)
            hit_axis.bar(router, Spread.of_runs(runs, "hit_rate").median)
        ttft_axis.set_ylabel("TTFT p50 (s), one dot per seed, bar = median")
        hit_axis.set_ylabel("fleet prefix-cache hit rate (median)")
        ttft_axis.set_title(f"{workload}: 2 CPU replicas of SmolLM2, by router", fontsize=9)
        for axis in (ttft_axis, hit_axis):
            axis.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="one seed, chat only (a smoke run; no goals)")
    parser.add_argument("--routers", nargs="+", choices=CHAT_ROUTERS, help="only these")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, help="default: all but eviction")
    parser.add_argument("--output", type=Path, help="default: bench/results/router_cpu[_quick].json")
    args = parser.parse_args()
    import ray

    args.output = args.output or Path(f"bench/results/router_cpu{'_quick' if args.quick else ''}.json")
    seeds = args.seeds[:1] if args.quick else args.seeds
    plan = (
        {"chat": tuple(args.routers or CHAT_ROUTERS)}
        if args.quick
        else {
            w: tuple(r for r in WORKLOADS[w] if r in (args.routers or WORKLOADS[w]))
            for w in args.workloads or ("chat", "skewed", "uniform")
        }
    )

    run = BenchmarkRun("router", args.output, GOALS)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    deployed = sorted({router for routers in plan.values() for router in routers}, key=CHAT_ROUTERS.index)
    apps = {router: {**APP_ARGS, "request_router": router} for router in deployed}
    cluster = serve_cluster.start(
        serve_cluster.config_with_apps(work_dir / "serve_config.yaml", apps), work_dir
    )
    results: dict[str, dict[str, list[dict]]] = {w: {r: [] for r in routers} for w, routers in plan.items()}
    output = {
        "seeds": seeds,
        "workloads": {
            "chat": CHAT,
            "chat_max_tokens": CHAT_MAX_TOKENS,
            "eviction": EVICTION,
            "skewed_uniform": LOAD_WORKLOAD,
        },
        "replicas": APP_ARGS,
        "results": results,
    }
    try:
        for router in deployed:  # every app must be up, and warm
            cluster.wait_ready(f"/{router}")
            warm_up(cluster, router)
        if "eviction" in plan:  # kills replicas: through Ray
            ray.init(address=cluster.ray_address, logging_level="ERROR", log_to_driver=False)
        for seed in seeds:  # seed by seed, so host drift falls on every router alike
            for workload, routers in plan.items():
                for router in routers:
                    summary = run_once(cluster, workload, router, seed)
                    results[workload][router].append({"seed": seed, **summary})
                    print(workload, router, seed, json.dumps(summary), flush=True)
                    run.write(output, goals_met={})  # so far, if the run breaks
    finally:
        ray.shutdown()
        serve_cluster.stop(cluster)

    print_table(results)
    met: dict[str, bool] = {}  # --quick: a smoke run, not judged
    if not args.quick:
        ratios, met = judge(results)
        for name, value in ratios.items():
            verdict = "PASS" if met[f"{name}_max"] else "MISS"
            goal = f"goal <= {GOALS[f'{name}_max']}"
            print(f"{name}: {value:.2f} ({goal}): {verdict}")
        print_verdicts({name: ok for name, ok in met.items() if name.removesuffix("_max") not in ratios})
        output["ratios"] = {name: asdict(value) for name, value in ratios.items()}
    run.write(output, met)
    plot(args.output.with_suffix(".png"), results)


if __name__ == "__main__":
    main()
