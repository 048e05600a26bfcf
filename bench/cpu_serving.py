"""`python -m bench.cpu_serving`: serve_config.yaml over HTTP on this CPU, on issue 13's workload,
next to the llama.cpp figures that issue measured on this machine (quoted, not re-run here).

Workload: 32 requests, prompts of 16-1024 tokens of real English text (log-uniform; see
bench/text_prompts.py), outputs of 16-256 tokens (log-uniform, ignore_eos, exact max_tokens),
greedy, streamed over /v1/completions; fixed seed. Runs: closed loop with 1 and with 16 clients,
and Poisson arrivals at 0.5/s (3 arrival seeds: median and spread). Two apps side by side on one
local Ray cluster, one replica each, run one at a time: serve_config.yaml as shipped (dtype auto:
bf16 on CPUs with native bf16) and the same with dtype float32 (the baseline in this run).
Prefix caching stays on, as shipped, but every run (and the warm-up) sends its own cache_salt, so
no run finds the prompts another left cached: llama.cpp ran with its prompt cache off.

Serving overhead: the client's mean time between tokens and mean TTFT at c=1 over HTTP, minus
the same c=1 run straight into an AsyncEngine in this process (no Ray, no HTTP), for dtype auto.
Writes bench/results/cpu_serving.json and .png."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench import http_load
from bench.driver import (
    Arrival,
    BenchmarkRun,
    EngineClient,
    Spread,
    engine_as_served,
    greedy,
    print_verdicts,
    pyplot,
)
from bench.text_prompts import text_prompts
from harness import serve_cluster
from harness.latency import RequestTiming, summarize
from harness.pacing import closed_loop
from harness.random_workload import log_uniform, poisson_times

NUM_REQUESTS = 32
POISSON_RATE = 0.5
POISSON_SEEDS = (0, 1, 2)
SYSTEMS = {"auto": {}, "float32": {"dtype": "float32"}}  # engine settings over serve_config's
# Issue 13's llama.cpp llama-server figures (16 slots, 2 threads, same weights, same workload).
PEERS = {
    "llama.cpp F32": {"c1_tok_s": 64.4, "c1_tbt_p50_s": 0.0123, "c16_tok_s": 119.9, "c16_ttft_p50_s": 1.45,
                      "c16_tbt_p99_s": 0.98, "poisson_ttft_p50_s": 0.45, "poisson_tbt_p99_s": 0.53},
    "llama.cpp Q4_1": {"c1_tok_s": 70.8, "c1_tbt_p50_s": 0.0079, "c16_tok_s": 77.7, "c16_ttft_p50_s": 2.97,
                       "c16_tbt_p99_s": 2.18, "poisson_ttft_p50_s": 1.24, "poisson_tbt_p99_s": 1.22},
}  # fmt: skip
GOALS = {"c1_tbt_p50_s_max": 0.010, "c16_output_tok_per_s_min": 240.0, "tbt_p99_s_under_load_max": 0.3}


def shipped_tokenizer():
    from transformers import AutoTokenizer

    from common.model_source import DEFAULT_MODEL, resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL).hf_dir)


def workload(seed: int, tokenizer) -> list[Arrival]:
    rng = random.Random(seed)
    prompt_lens = [log_uniform(rng, 16, 1024) for _ in range(NUM_REQUESTS)]
    output_lens = [log_uniform(rng, 16, 256) for _ in range(NUM_REQUESTS)]
    prompts = text_prompts(tokenizer, prompt_lens, seed)
    return [Arrival(0.0, p, n) for p, n in zip(prompts, output_lens, strict=True)]


def poisson(arrivals: list[Arrival], seed: int) -> list[Arrival]:
    times = poisson_times(random.Random(seed), len(arrivals), POISSON_RATE)
    return [Arrival(t, a.prompt, a.max_tokens) for a, t in zip(arrivals, times, strict=True)]


def engine_alone_c1(arrivals: list[Arrival], engine_settings: dict) -> dict[str, float]:
    """The c=1 run straight into an AsyncEngine in this process (no Ray, no HTTP), built as the
    app builds it: what the engine costs per token and per request without the serving around it."""
    client = EngineClient(engine_as_served(engine_settings))
    try:
        _, served = asyncio.run(
            closed_loop(lambda arrival: client.send(arrival.prompt, greedy(arrival.max_tokens)), arrivals, 1)
        )
    finally:
        client.engine.shutdown()
    return {
        "tbt_mean_s": statistics.fmean(i for s in served for i in s.timing.token_intervals_s),
        "ttft_mean_s": statistics.fmean(s.timing.ttft_s for s in served),
    }


def serving_overhead(timings: list[RequestTiming], alone: dict[str, float]) -> dict[str, float]:
    """The client's means at c=1 over HTTP minus the engine's own, on the same requests."""
    client_tbt = statistics.fmean(i for t in timings for i in t.token_intervals_s)
    client_ttft = statistics.fmean(t.ttft_s for t in timings)
    return {
        "client_tbt_mean_s": client_tbt,
        "engine_alone_tbt_mean_s": alone["tbt_mean_s"],
        "per_token_s": client_tbt - alone["tbt_mean_s"],
        "client_ttft_mean_s": client_ttft,
        "engine_alone_ttft_mean_s": alone["ttft_mean_s"],
        "per_request_s": client_ttft - alone["ttft_mean_s"],
    }


def measure(cluster: serve_cluster.ServeCluster, system: str, arrivals: list[Arrival]) -> dict:
    url = f"{cluster.base_url}/{system}/v1/completions"
    wall_s, c1_timings = asyncio.run(http_load.closed_loop(url, arrivals, 1))
    c1 = summarize(wall_s, c1_timings)
    print(system, "c=1", json.dumps(c1), flush=True)
    wall_s, c16_timings = asyncio.run(http_load.closed_loop(url, arrivals, 16))
    c16 = summarize(wall_s, c16_timings)
    print(system, "c=16", json.dumps(c16), flush=True)
    runs: list[dict[str, float]] = []
    poisson_timings: list[RequestTiming] = []
    for seed in POISSON_SEEDS:
        wall_s, timings = asyncio.run(http_load.open_loop(url, poisson(arrivals, seed)))
        runs.append(summarize(wall_s, timings))
        poisson_timings += timings
        print(system, f"poisson seed {seed}", json.dumps(runs[-1]), flush=True)
    spread = {key: Spread.of_runs(runs, key) for key in runs[0]}
    return {
        "c1": c1,
        "c16": c16,
        "poisson": {
            "median": {key: s.median for key, s in spread.items()},
            "spread": {key: asdict(s) for key, s in spread.items()},
            "runs": runs,
        },
        "timings": {"c1": c1_timings, "c16": c16_timings, "poisson": poisson_timings},
    }


def goals_met(results: dict) -> dict[str, bool]:
    """On the app as shipped (dtype auto)."""
    ours = results["auto"]
    return {
        "c=1 TBT p50 <= 10 ms": ours["c1"]["tbt_p50_s"] <= GOALS["c1_tbt_p50_s_max"],
        "c=16 output >= 240 tok/s": ours["c16"]["output_tok_per_s"] >= GOALS["c16_output_tok_per_s_min"],
        "c=16 TBT p99 <= 0.3 s": ours["c16"]["tbt_p99_s"] <= GOALS["tbt_p99_s_under_load_max"],
        "Poisson TBT p99 (median of seeds) <= 0.3 s": ours["poisson"]["median"]["tbt_p99_s"]
        <= GOALS["tbt_p99_s_under_load_max"],
    }


def print_table(results: dict, overheads: dict, offered_tok_s: float) -> None:
    header = ("c=1 tok/s", "c=1 TBT p50", "c=16 tok/s", "c=16 TTFT p50", "c=16 TBT p99", "Poi TTFT p50",
              "Poi TBT p99", "Poi tok/s")  # fmt: skip
    print(f"{'server':<22}" + "".join(f"{h:>14}" for h in header))
    for name, peer in PEERS.items():
        row = (peer["c1_tok_s"], peer["c1_tbt_p50_s"] * 1e3, peer["c16_tok_s"], peer["c16_ttft_p50_s"],
               peer["c16_tbt_p99_s"], peer["poisson_ttft_p50_s"], peer["poisson_tbt_p99_s"])  # fmt: skip
        print(f"{name + ' (quoted)':<22}" + "".join(f"{v:>14.2f}" for v in row) + f"{'-':>14}")
    for system, r in results.items():
        p = r["poisson"]["median"]
        row = (r["c1"]["output_tok_per_s"], r["c1"]["tbt_p50_s"] * 1e3, r["c16"]["output_tok_per_s"],
               r["c16"]["ttft_p50_s"], r["c16"]["tbt_p99_s"], p["ttft_p50_s"], p["tbt_p99_s"],
               p["output_tok_per_s"])  # fmt: skip
        print(f"{'stallfree ' + system:<22}" + "".join(f"{v:>14.2f}" for v in row))
    print(f"(c=1 TBT in ms, the rest s or tok/s; Poisson {POISSON_RATE}/s offers {offered_tok_s:.1f} tok/s; "
          f"Poisson columns: median of seeds {list(POISSON_SEEDS)})")  # fmt: skip
    for system, o in overheads.items():
        ms = {key: value * 1e3 for key, value in o.items()}
        print(
            f"serving overhead ({system}, c=1): per token {ms['per_token_s']:.2f} ms (client TBT mean "
            f"{ms['client_tbt_mean_s']:.1f} ms, engine alone {ms['engine_alone_tbt_mean_s']:.1f} ms); "
            f"per request {ms['per_request_s']:.1f} ms (client TTFT mean {ms['client_ttft_mean_s']:.0f} "
            f"ms, engine alone {ms['engine_alone_ttft_mean_s']:.0f} ms)"
        )


def plot(path: Path, results: dict) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    for axis, run in zip(axes, ("c1", "c16", "poisson"), strict=True):
        for system, r in results.items():
            gaps = sorted(g for t in r["timings"][run] for g in t.token_intervals_s)
            axis.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=f"stallfree {system}")
        for name, peer in PEERS.items():
            quoted = {"c1": None, "c16": peer["c16_tbt_p99_s"], "poisson": peer["poisson_tbt_p99_s"]}[run]
            if quoted is not None:
                axis.axvline(quoted, linestyle=":", color="gray")
                axis.annotate(f"{name} p99", (quoted, 0.5), rotation=90, fontsize=7)
        axis.set_xscale("log")
        axis.set_xlabel("time between tokens (s)")
        axis.set_title(run)
    axes[0].set_ylabel("fraction of token intervals")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _without_timings(result: dict) -> dict:
    return {key: value for key, value in result.items() if key != "timings"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="workload seed (prompts, lengths)")
    parser.add_argument("--output", type=Path, default=Path("bench/results/cpu_serving.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("cpu_serving", args.output, GOALS)
    arrivals = workload(args.seed, shipped_tokenizer())
    # First, before Ray starts and before this process runs any other torch work (see AsyncEngine).
    alone = engine_alone_c1(arrivals, SYSTEMS["auto"])
    print("engine alone, c=1:", json.dumps(alone), flush=True)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-cpu-serving-"))
    cluster = serve_cluster.start(
        serve_cluster.config_with_apps(
            work_dir / "serve_config.yaml", {s: {"engine": e} for s, e in SYSTEMS.items()}
        ),
        work_dir,
    )
    results = {}
    try:
        for system in SYSTEMS:
            cluster.wait_ready(f"/{system}")
            url = f"{cluster.base_url}/{system}/v1/completions"
            asyncio.run(http_load.closed_loop(url, arrivals[:4], 4))  # warm: kernels, first steps
            results[system] = measure(cluster, system, arrivals)
    finally:
        serve_cluster.stop(cluster)
    offered = POISSON_RATE * statistics.fmean(a.max_tokens for a in arrivals)
    overheads = {"auto": serving_overhead(results["auto"]["timings"]["c1"], alone)}
    print_table(results, overheads, offered)
    met = goals_met(results)
    print_verdicts(met)
    body = {
        "workload": {
            "num_requests": NUM_REQUESTS,
            "seed": args.seed,
            "prompt_tokens": [len(a.prompt) for a in arrivals],
            "max_tokens": [a.max_tokens for a in arrivals],
            "poisson_rate_per_s": POISSON_RATE,
            "poisson_seeds": list(POISSON_SEEDS),
            "poisson_offered_tok_per_s": offered,
        },
        "systems": {system: {"engine": SYSTEMS[system]} for system in SYSTEMS},
        "peers_quoted_from_issue_13": PEERS,
        "results": {system: _without_timings(r) for system, r in results.items()},
        "serving_overhead": overheads,
        "requests": {
            system: {run: [asdict(t) for t in ts] for run, ts in r["timings"].items()}
            for system, r in results.items()
        },
    }
    run.write(body, met)
    plot(args.output.with_suffix(".png"), results)


if __name__ == "__main__":
    main()
