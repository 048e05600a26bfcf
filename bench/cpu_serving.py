"""`python -m bench.cpu_serving`: serve_config.yaml over HTTP on this CPU, side by side with the
servers a CPU user would run instead (bench/peers.py: llama.cpp F32 and Q4_1, vLLM's CPU backend,
Ray Serve LLM over the same vLLM engine), each run in this run where `../shared/peers/` has
installed it, else its last measured figures quoted and labelled so (issue 23). The same app with
its engine core in a process of its own (`core_process: true`, issue 36) runs too, against the
shipped shape (the core on a thread of the replica's process) in the same run.

Workload: 32 requests, prompts of 16-1024 tokens of real English text (log-uniform; see
bench/text_prompts.py), outputs of 16-256 tokens (log-uniform, ignore_eos, exact max_tokens),
greedy, streamed over /v1/completions; fixed seed. Runs, per server, one server at a time on the
2 cores: closed loop with 1 and with 16 clients, and Poisson arrivals at 0.5/s (3 arrival seeds:
median and spread). Every run (and warm-up) sends its own cache_salt, so stallfree's prefix cache
(on, as shipped) finds nothing another run left; the peers run with their prompt caches off.

The engine alone: the same c=1 and c=16 runs straight into an AsyncEngine in this process, its core
on a thread (no Ray, no HTTP, no second process). Serving overhead: the client's mean time between
tokens and mean TTFT at c=1 over HTTP, minus the engine alone's. Where the cores went: each
server's c=16 run records CPU seconds per process (bench/cpu_split.py).
Writes bench/results/cpu_serving.json, .png and .raw.json.gz (each request's timing). Not part
of make test or CI (~35 minutes with every peer installed)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench import http_load, peers
from bench.cpu_split import cpu_split
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
from common.latency import RequestTiming, summarize
from harness import serve_cluster
from harness.pacing import closed_loop
from harness.random_workload import log_uniform, poisson_times

NUM_REQUESTS = 32
POISSON_RATE = 0.5
POISSON_SEEDS = (0, 1, 2)
OURS = "stallfree"
OURS_PROCESS = "stallfree, core in its own process"  # the app with core_process true
VLLM, Q4, RAY_LLM = "vLLM CPU", "llama.cpp Q4_1", "Ray Serve LLM"
GOALS = {
    "c16_output_tok_per_s_vs_engine_alone_min": 0.9,
    "c16_output_tok_per_s_vs_vllm_min": 1.5,
    "c16_tbt_p99_vs_vllm_max": 0.5,
    "ttft_p50_vs_every_peer_max": 0.8,  # at c=1 and at c=16
    "c1_tbt_p50_vs_llama_cpp_q4_1_max": 0.9,  # issue 39: the same Q4_1 file, served natively
    "c16_output_tok_per_s_vs_llama_cpp_q4_1_min": 1.5,
    "overhead_per_token_s_max": 0.001,
    "overhead_per_request_s_max": 0.020,
    "poisson_tbt_p99_vs_vllm_max": 0.5,  # median of the seeds
    "ahead_of_ray_serve_llm_on_every_figure": True,
}
HIGHER_IS_BETTER = ("output_tok_per_s",)


def shipped_tokenizer():
    from transformers import AutoTokenizer

    from common.model_source import DEFAULT_MODEL, resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL).hf_dir)


def workload(
    seed: int,
    tokenizer,
    num_requests: int = NUM_REQUESTS,
    prompt_range: tuple[int, int] = (16, 1024),
    output_range: tuple[int, int] = (16, 256),
) -> list[Arrival]:
    """Text prompts and greedy output lengths, each log-uniform in its range."""
    rng = random.Random(seed)
    prompt_lens = [log_uniform(rng, *prompt_range) for _ in range(num_requests)]
    output_lens = [log_uniform(rng, *output_range) for _ in range(num_requests)]
    prompts = text_prompts(tokenizer, prompt_lens, seed)
    return [Arrival(0.0, p, n) for p, n in zip(prompts, output_lens, strict=True)]


def poisson(arrivals: list[Arrival], seed: int) -> list[Arrival]:
    times = poisson_times(random.Random(seed), len(arrivals), POISSON_RATE)
    return [Arrival(t, a.prompt, a.max_tokens) for a, t in zip(arrivals, times, strict=True)]


def engine_alone(arrivals: list[Arrival]) -> dict[str, dict[str, float]]:
    """The c=1 and c=16 runs straight into an AsyncEngine in this process, built as the app builds
    its replica's but with the core on a thread: what the engine does without the serving around it."""
    client = EngineClient(engine_as_served({"core_process": False}))

    def run(concurrency: int) -> tuple[float, list[RequestTiming]]:
        salt = f"alone-c{concurrency}"  # each run its own, as over HTTP: nothing found cached
        wall_s, served = asyncio.run(
            closed_loop(
                lambda a: client.send(a.prompt, greedy(a.max_tokens, cache_salt=salt)), arrivals, concurrency
            )
        )
        return wall_s, [s.timing for s in served]

    try:
        run(4)  # warm, as the servers are
        (_, c1), (c16_wall_s, c16) = run(1), run(16)
    finally:
        client.engine.shutdown()
    return {
        "c1": {
            "tbt_mean_s": statistics.fmean(i for t in c1 for i in t.token_intervals_s),
            "tbt_p50_s": statistics.median(i for t in c1 for i in t.token_intervals_s),
            "ttft_mean_s": statistics.fmean(t.ttft_s for t in c1),
        },
        "c16": summarize(c16_wall_s, c16),
    }


def serving_overhead(timings: list[RequestTiming], alone: dict[str, dict[str, float]]) -> dict[str, float]:
    """The client's means at c=1 over HTTP minus the engine's own, on the same requests."""
    client_tbt = statistics.fmean(i for t in timings for i in t.token_intervals_s)
    client_ttft = statistics.fmean(t.ttft_s for t in timings)
    return {
        "client_tbt_mean_s": client_tbt,
        "engine_alone_tbt_mean_s": alone["c1"]["tbt_mean_s"],
        "per_token_s": client_tbt - alone["c1"]["tbt_mean_s"],
        "client_ttft_mean_s": client_ttft,
        "engine_alone_ttft_mean_s": alone["c1"]["ttft_mean_s"],
        "per_request_s": client_ttft - alone["c1"]["ttft_mean_s"],
    }


def measure(url: str, name: str, arrivals: list[Arrival], model: str | None = None) -> dict:
    asyncio.run(http_load.closed_loop(url, arrivals[:4], 4, model))  # warm: kernels, first steps
    wall_s, c1_timings = asyncio.run(http_load.closed_loop(url, arrivals, 1, model))
    c1 = summarize(wall_s, c1_timings)
    print(name, "c=1", json.dumps(c1), flush=True)
    with cpu_split() as c16_cpu:
        wall_s, c16_timings = asyncio.run(http_load.closed_loop(url, arrivals, 16, model))
    c16 = summarize(wall_s, c16_timings)
    print(name, "c=16", json.dumps(c16), flush=True)
    print(name, "c=16 CPU seconds by process", json.dumps(c16_cpu), flush=True)
    runs: list[dict[str, float]] = []
    poisson_timings: list[RequestTiming] = []
    for seed in POISSON_SEEDS:
        wall_s, timings = asyncio.run(http_load.open_loop(url, poisson(arrivals, seed), model=model))
        runs.append(summarize(wall_s, timings))
        poisson_timings += timings
        print(name, f"poisson seed {seed}", json.dumps(runs[-1]), flush=True)
    spread = {key: Spread.of_runs(runs, key) for key in runs[0]}
    return {
        "source": "measured in this run",
        "c1": c1,
        "c16": c16,
        "c16_cpu": c16_cpu,
        "poisson": {
            "median": {key: s.median for key, s in spread.items()},
            "spread": {key: asdict(s) for key, s in spread.items()},
            "runs": runs,
        },
        "timings": {"c1": c1_timings, "c16": c16_timings, "poisson": poisson_timings},
    }


def figures(result: dict) -> dict[str, float]:
    """A server's figures under the names of bench.peers' quoted table (plus Poisson, measured)."""
    if "quoted" in result:
        return result["quoted"]
    keys = ("output_tok_per_s", "ttft_p50_s", "tbt_p50_s", "tbt_p99_s")
    runs = {"c1": result["c1"], "c16": result["c16"], "poisson": result["poisson"]["median"]}
    return {f"{run}_{key}": summary[key] for run, summary in runs.items() for key in keys}


def ratios(results: dict) -> dict[str, dict[str, float]]:
    """Ours over each peer's, per figure both have."""
    ours = figures(results[OURS])
    return {
        name: {key: ours[key] / value for key, value in figures(r).items() if key in ours and value}
        for name, r in results.items()
        if name != OURS
    }


def ahead_on_every_figure(by_figure: dict[str, float]) -> bool:
    """Ours over theirs: higher throughput, lower latencies, on every figure both have."""
    return bool(by_figure) and all(
        ratio > 1 if key.endswith(HIGHER_IS_BETTER) else ratio < 1 for key, ratio in by_figure.items()
    )


def goals_met(results: dict, overhead: dict[str, float], alone_c16_tok_s: float) -> dict[str, bool]:
    """On the app as shipped; a ratio to a peer with no such figure (quoted: no Poisson) is unmet."""
    by_peer = ratios(results)
    vllm, q4 = by_peer.get(VLLM, {}), by_peer.get(Q4, {})
    g = GOALS
    every = [by_figure for name, by_figure in by_peer.items() if name != OURS_PROCESS]
    served_c16 = results[OURS]["c16"]["output_tok_per_s"]
    return {
        "served c=16 tok/s >= 0.9x the engine alone's": served_c16
        >= g["c16_output_tok_per_s_vs_engine_alone_min"] * alone_c16_tok_s,
        "ahead of Ray Serve LLM on every figure": ahead_on_every_figure(by_peer.get(RAY_LLM, {})),
        "c=16 output tok/s >= 1.5x vLLM CPU's": vllm.get("c16_output_tok_per_s", 0.0)
        >= g["c16_output_tok_per_s_vs_vllm_min"],
        "c=16 TBT p99 <= 0.5x vLLM CPU's": vllm.get("c16_tbt_p99_s", 1e9) <= g["c16_tbt_p99_vs_vllm_max"],
        "c=16 TTFT p50 <= 0.8x every peer's": all(
            r.get("c16_ttft_p50_s", 1e9) <= g["ttft_p50_vs_every_peer_max"] for r in every
        ),
        "c=1 TBT p50 <= 0.9x llama.cpp Q4_1's": q4.get("c1_tbt_p50_s", 1e9)
        <= g["c1_tbt_p50_vs_llama_cpp_q4_1_max"],
        "c=16 output tok/s >= 1.5x llama.cpp Q4_1's": q4.get("c16_output_tok_per_s", 0.0)
        >= g["c16_output_tok_per_s_vs_llama_cpp_q4_1_min"],
        "c=1 TTFT p50 <= 0.8x every peer's": all(
            r.get("c1_ttft_p50_s", 1e9) <= g["ttft_p50_vs_every_peer_max"] for r in every
        ),
        "serving overhead <= 1 ms per token": overhead["per_token_s"] <= g["overhead_per_token_s_max"],
        "serving overhead <= 20 ms per request": overhead["per_request_s"] <= g["overhead_per_request_s_max"],
        "Poisson TBT p99 (median of seeds) <= 0.5x vLLM CPU's": vllm.get("poisson_tbt_p99_s", 1e9)
        <= g["poisson_tbt_p99_vs_vllm_max"],
    }


COLUMNS = (  # (header, figure, scale)
    ("c=1 tok/s", "c1_output_tok_per_s", 1), ("c=1 TTFT p50", "c1_ttft_p50_s", 1e3),
    ("c=1 TBT p50", "c1_tbt_p50_s", 1e3), ("c=16 tok/s", "c16_output_tok_per_s", 1),
    ("c=16 TTFT p50", "c16_ttft_p50_s", 1e3), ("c=16 TBT p50", "c16_tbt_p50_s", 1e3),
    ("c=16 TBT p99", "c16_tbt_p99_s", 1e3), ("Poi TBT p99", "poisson_tbt_p99_s", 1e3),
)  # fmt: skip


def print_table(
    results: dict, overhead: dict[str, float], offered_tok_s: float, alone_c16: dict[str, float]
) -> None:
    print(f"{'server':<30}" + "".join(f"{h:>14}" for h, _, _ in COLUMNS))
    for name, r in results.items():
        f = figures(r)
        label = name + (" (quoted)" if "quoted" in r else "")
        cells = (f"{f[key] * scale:>14.1f}" if key in f else f"{'-':>14}" for _, key, scale in COLUMNS)
        print(f"{label:<30}" + "".join(cells))
    print(f"(tok/s, and ms; Poisson {POISSON_RATE}/s offers {offered_tok_s:.1f} tok/s, median of seeds "
          f"{list(POISSON_SEEDS)}; quoted: bench/peers.py, not this run)")  # fmt: skip
    served_c16 = results[OURS]["c16"]["output_tok_per_s"]
    print(f"engine alone (in process, core on a thread), c=16: {alone_c16['output_tok_per_s']:.1f} tok/s, "
          f"TBT p50 {alone_c16['tbt_p50_s'] * 1e3:.1f} ms; served / alone "
          f"{served_c16 / alone_c16['output_tok_per_s']:.2f}x")  # fmt: skip
    for name, by_figure in ratios(results).items():
        print(f"ours / {name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in by_figure.items()))
    ms = {key: value * 1e3 for key, value in overhead.items()}
    print(
        f"serving overhead (c=1): per token {ms['per_token_s']:.2f} ms (client TBT mean "
        f"{ms['client_tbt_mean_s']:.1f} ms, engine alone {ms['engine_alone_tbt_mean_s']:.1f} ms); "
        f"per request {ms['per_request_s']:.1f} ms (client TTFT mean {ms['client_ttft_mean_s']:.0f} "
        f"ms, engine alone {ms['engine_alone_ttft_mean_s']:.0f} ms)"
    )


def requests(results: dict) -> dict[str, dict[str, list[dict]]]:
    """Per measured server and run, each request's timing: the side file, and what the plot draws."""
    return {
        name: {run: [asdict(t) for t in ts] for run, ts in r["timings"].items()}
        for name, r in results.items()
        if "timings" in r  # quoted: no requests
    }


def plot(path: Path, raw: dict[str, dict[str, list[dict]]]) -> None:
    """From `requests(...)`, or the side file it went to (bench.driver.raw_path)."""
    plt = pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    for axis, run in zip(axes, ("c1", "c16", "poisson"), strict=True):
        for name, by_run in raw.items():
            gaps = sorted(g for t in by_run[run] for g in t["token_intervals_s"])
            axis.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=name)
        axis.set_xscale("log")
        axis.set_xlabel("time between tokens (s)")
        axis.set_title(run)
    axes[0].set_ylabel("fraction of token intervals")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _summary(result: dict) -> dict:
    """A server's figures, without its requests' timings and its CPU split (listed apart)."""
    return {key: value for key, value in result.items() if key not in ("timings", "c16_cpu")}


def measure_peers(arrivals: list[Arrival], wanted: set[str], log_dir: Path) -> dict[str, dict]:
    """Each installed peer measured in turn (its server alone on the cores); the others quoted."""
    results: dict[str, dict] = {}
    for peer in peers.PEERS:
        if peer.name in wanted and peer.installed:
            with peers.serving(peer, log_dir / f"{peer.name.replace(' ', '_')}.log"):
                results[peer.name] = measure(peer.url, peer.name, arrivals, peer.model)
        else:
            why = "not asked for (--peers)" if peer.installed else "not installed"
            print(f"{peer.name}: {why} ({peer.installed_at}); quoting its 2026-11-24 figures", flush=True)
            results[peer.name] = {"source": f"quoted: {why}", "quoted": peer.quoted}
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="workload seed (prompts, lengths)")
    every_peer = ",".join(p.name for p in peers.PEERS)
    parser.add_argument("--peers", default=every_peer, help="peers to run where installed")
    parser.add_argument("--output", type=Path, default=Path("bench/results/cpu_serving.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("cpu_serving", args.output, GOALS)
    arrivals = workload(args.seed, shipped_tokenizer())
    # First, before Ray starts and before this process runs any other torch work (see ThreadCore).
    alone = engine_alone(arrivals)
    print("engine alone:", json.dumps(alone), flush=True)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-cpu-serving-"))
    results = measure_peers(arrivals, set(args.peers.split(",")), work_dir)
    process_config = serve_cluster.config_with_apps(
        work_dir / "core_process.yaml", {"stallfree": {"engine": {"core_process": True}}}
    )
    ours = {}
    for name, config, route in (
        (OURS, serve_cluster.REPO / "serve_config.yaml", ""),
        (OURS_PROCESS, process_config, "/stallfree"),
    ):
        cluster = serve_cluster.start(config, work_dir)
        try:
            cluster.wait_ready(route)
            ours[name] = measure(f"{cluster.base_url}{route}/v1/completions", name, arrivals)
        finally:
            serve_cluster.stop(cluster)
    results = {**ours, **results}
    offered = POISSON_RATE * statistics.fmean(a.max_tokens for a in arrivals)
    overhead = serving_overhead(results[OURS]["timings"]["c1"], alone)
    print_table(results, overhead, offered, alone["c16"])
    met = goals_met(results, overhead, alone["c16"]["output_tok_per_s"])
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
        "peers": {p.name: {"command": p.command, "source": results[p.name]["source"]} for p in peers.PEERS},
        "results": {name: _summary(r) for name, r in results.items()},
        "c16_cpu": {name: r["c16_cpu"] for name, r in results.items() if "c16_cpu" in r},
        "ratios_ours_over_peer": ratios(results),
        "serving_overhead": overhead,
        "engine_alone": alone,
        "served_c16_over_engine_alone": results[OURS]["c16"]["output_tok_per_s"]
        / alone["c16"]["output_tok_per_s"],
    }
    raw = requests(results)
    run.write(body, met, raw)
    plot(args.output.with_suffix(".png"), raw)


if __name__ == "__main__":
    main()
