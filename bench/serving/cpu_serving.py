"""`python -m bench cpu_serving`: serve_config.yaml over HTTP on this CPU, side by side with the
servers a CPU user would run instead (bench/peers.py: llama.cpp F32 and Q4_1, vLLM's CPU backend,
Ray Serve LLM over the same vLLM engine), each run in this run where `../shared/peers/` has
installed it, else its last measured figures quoted and labelled so. The same app with its engine
core in a process of its own (`core_process: true`) runs too, and the engine alone.

Workload: 32 requests, prompts of 16-1024 tokens of real English text (log-uniform; see
bench/text_prompts.py), outputs of 16-256 tokens (log-uniform, ignore_eos, exact max_tokens),
greedy, streamed over /v1/completions; fixed seed. Every run (and warm-up) sends its own
cache_salt, so stallfree's prefix cache (on, as shipped) finds nothing another run left; the peers
run with their prompt caches off.

Interleaved rounds (bench/serving/serving_rounds.py): each round takes every server in turn, started, alone
on the 2 cores, then stopped (A B C ..., A B C ...): closed loop with 1 and with 16 clients, and
Poisson arrivals at 0.5/s with the round's own arrival seed (3 rounds: 3 seeds). Figures are the
median over the rounds; comparisons are ratios taken within each round, then their median; rounds
whose ratios disagree by more than 15% are named. Our clusters run with Ray's own report intervals
(harness.serve_cluster.BENCH_CLUSTER_ENV), as a user's does; each round reads back how many
messages carried its tokens from the replica to the Ingress.

The engine alone: the same runs straight into an AsyncEngine in this process, its core on a thread
(no Ray, no HTTP, no second process), built once before anything else and measured in every round.
Serving overhead: the client's mean time between tokens and mean TTFT at c=1 over HTTP, minus the
engine alone's in the same round. Where the cores went: each server's c=16 run records CPU seconds
per process (bench/serving/cpu_split.py). Writes bench/results/cpu_serving.json, .png and .raw.json.gz
(each request's timing). Not part of make test or CI (~70 minutes with every peer installed)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from bench import peers
from bench.driver import (
    Arrival,
    BenchmarkRun,
    EngineClient,
    engine_as_served,
    engine_sender,
    print_verdicts,
)
from bench.http_load import Sender, http_sender, run_paced
from bench.serving.cpu_serving_report import (
    ALONE,
    GOALS,
    OURS,
    OURS_PROCESS,
    POISSON_RATE,
    goals_met,
    plot,
    print_table,
)
from bench.serving.cpu_split import cpu_split
from bench.serving.serving_rounds import (
    combine,
    disagreement,
    median_ratios,
    ratios_by_round,
)
from bench.text_prompts import text_prompts
from common.latency import RequestTiming, summarize
from harness import serve_cluster
from harness.metrics_scrape import EngineCounters, settled
from harness.pacing import closed_loop, open_loop
from harness.random_workload import log_uniform, poisson_times

NUM_REQUESTS = 32
ROUNDS = 3  # each with one Poisson seed: seeds 0, 1, 2
# Ray's default metrics report interval is 10 s: counts unchanged over 2.5 of them are all in.
SETTLE_S = 25.0


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


@dataclass(frozen=True)
class Server:
    """One of the servers side by side: `serving(log_dir)` has it up and answering while its
    block runs and yields its completions URL; None where it is quoted, not run."""

    name: str
    serving: Callable[[Path], AbstractContextManager[str]] | None
    model: str | None = None  # what requests name in "model", for a server that routes by it
    quoted: dict | None = None  # not run: its last measured figures, and why
    # ours: per round, the messages that carried its tokens from the replica to the Ingress
    stream_counts: list[dict[str, float]] = field(default_factory=list)


def ours(name: str, config: Path, route: str = "") -> Server:
    counts: list[dict[str, float]] = []

    @contextmanager
    def serving(log_dir: Path) -> Iterator[str]:
        cluster = serve_cluster.start(config, log_dir, cluster_env=serve_cluster.BENCH_CLUSTER_ENV)
        try:
            cluster.wait_ready(route)
            yield f"{cluster.base_url}{route}/v1/completions"
            read = settled(lambda: EngineCounters.scrape(cluster, cluster.app_name), SETTLE_S)
            counts.append({"messages": read.stream_messages, "tokens": read.generation_tokens})
        finally:
            serve_cluster.stop(cluster)

    return Server(name, serving, stream_counts=counts)


def peer_server(peer: peers.Peer, wanted: set[str]) -> Server:
    if peer.name in wanted and peer.installed:

        @contextmanager
        def serving(log_dir: Path) -> Iterator[str]:
            with peers.serving(peer, log_dir / f"{peer.name.replace(' ', '_')}.log"):
                yield peer.url

        return Server(peer.name, serving, peer.model)
    why = "not asked for (--peers)" if peer.installed else "not installed"
    print(f"{peer.name}: {why} ({peer.installed_at}); quoting its last measured figures", flush=True)
    return Server(peer.name, None, quoted={"source": f"quoted: {why}", "quoted": peer.quoted})


def one_round(sender: Sender, arrivals: list[Arrival], seed: int) -> dict:
    """A server's runs in one round: warm, c=1, c=16 (with where the cores went), and Poisson with
    the round's arrival seed; each run with a cache salt of its own."""
    run_paced(sender, partial(closed_loop, items=arrivals[:4], concurrency=4))  # kernels, first steps
    c1 = run_paced(sender, partial(closed_loop, items=arrivals, concurrency=1))
    with cpu_split() as c16_cpu:
        c16 = run_paced(sender, partial(closed_loop, items=arrivals, concurrency=16))
    poisson_run = run_paced(sender, partial(open_loop, items=poisson(arrivals, seed)))
    return {
        "c1": summarize(*c1),
        "c16": summarize(*c16),
        "poisson": summarize(*poisson_run),
        "c16_cpu": c16_cpu,
        "timings": {"c1": c1[1], "c16": c16[1], "poisson": poisson_run[1]},
    }


def serving_overhead(ours_c1: list[RequestTiming], alone_c1: list[RequestTiming]) -> dict[str, float]:
    """The client's means at c=1 over HTTP minus the engine alone's, on the same requests."""
    client_tbt = statistics.fmean(i for t in ours_c1 for i in t.token_intervals_s)
    alone_tbt = statistics.fmean(i for t in alone_c1 for i in t.token_intervals_s)
    client_ttft = statistics.fmean(t.ttft_s for t in ours_c1)
    alone_ttft = statistics.fmean(t.ttft_s for t in alone_c1)
    return {
        "client_tbt_mean_s": client_tbt,
        "engine_alone_tbt_mean_s": alone_tbt,
        "per_token_s": client_tbt - alone_tbt,
        "client_ttft_mean_s": client_ttft,
        "engine_alone_ttft_mean_s": alone_ttft,
        "per_request_s": client_ttft - alone_ttft,
    }


def servers(wanted: set[str], work_dir: Path) -> list[Server]:
    process_config = serve_cluster.config_with_apps(
        work_dir / "core_process.yaml", {"stallfree": {"engine": {"core_process": True}}}
    )
    return [
        ours(OURS, serve_cluster.SHIPPED_CONFIG),
        ours(OURS_PROCESS, process_config, "/stallfree"),
        *(peer_server(peer, wanted) for peer in peers.PEERS),
    ]


def run_rounds(
    arrivals: list[Arrival],
    line_up: list[Server],
    rounds: int,
    work_dir: Path,
    after_round: Callable[[dict[str, list[dict]]], None],
) -> None:
    """Every round: the engine alone, then each server in turn, each its own run of one_round;
    after_round gets every round's results so far."""
    client = EngineClient(engine_as_served({"core_process": False}))  # first: before Ray, see ThreadCore
    measured: dict[str, list[dict]] = {}
    try:
        for index in range(rounds):
            print(f"-- round {index + 1} of {rounds}", flush=True)
            measured.setdefault(ALONE, []).append(one_round(engine_sender(client), arrivals, index))
            for server in line_up:
                if server.serving is not None:
                    measured.setdefault(server.name, []).append(
                        _measured_or_failed(server, arrivals, index, work_dir)
                    )
            after_round(measured)
    finally:
        client.engine.shutdown()


def _measured_or_failed(server: Server, arrivals: list[Arrival], index: int, work_dir: Path) -> dict:
    """One server's round, or why it could not run (a server that fails to start or dies in a
    round is named in the result, and the other servers go on)."""
    try:
        with server.serving(work_dir) as url:
            result = one_round(http_sender(url, server.model), arrivals, index)
    except Exception as error:
        print(f"{server.name}: round {index + 1} failed: {error!r}"[:2000], flush=True)
        return {"failed": f"{type(error).__name__}: {error}"[:2000]}
    print(server.name, json.dumps({run: result[run] for run in ("c1", "c16")}), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="workload seed (prompts, lengths)")
    every_peer = ",".join(p.name for p in peers.PEERS)
    parser.add_argument("--peers", default=every_peer, help="peers to run where installed")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds, each a Poisson seed")
    parser.add_argument("--requests", type=int, default=NUM_REQUESTS, help="the workload's first N (a check)")
    parser.add_argument("--output", type=Path, default=Path("bench/results/cpu_serving.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("cpu_serving", args.output, GOALS)
    arrivals = workload(args.seed, shipped_tokenizer())[: args.requests]
    work_dir = Path(tempfile.mkdtemp(prefix="bench-cpu-serving-"))
    line_up = servers(set(args.peers.split(",")), work_dir)
    run_rounds(arrivals, line_up, args.rounds, work_dir, partial(report, run, line_up, arrivals, args))


def report(run: BenchmarkRun, line_up: list[Server], arrivals: list[Arrival], args, measured: dict) -> None:
    """The result of the rounds done so far, written after each: a run cut short keeps them."""
    body = summary(measured, line_up, arrivals, args)
    print_table(body["results"], body)
    quoted = {name for name, result in body["results"].items() if "quoted" in result}
    met = goals_met(
        body["ratios_ours_over_peer"], body["serving_overhead"], body["served_c16_over_engine_alone"], quoted
    )
    print_verdicts(met)
    raw = {
        name: {
            r: [asdict(t) for rr in rounds if "timings" in rr for t in rr["timings"][r]]
            for r in ("c1", "c16", "poisson")
        }
        for name, rounds in measured.items()
    }
    run.write(body, met, raw)
    plot(args.output.with_suffix(".png"), raw)


def summary(measured: dict[str, list[dict]], line_up: list[Server], arrivals: list[Arrival], args) -> dict:
    """The result file's body: per server its figures (medians over the rounds), our ratios over
    each other server (paired within rounds, then the median), where they moved between rounds."""
    results = {
        name: {"source": "measured in this run", **combine([_figures(r) for r in ran])}
        for name, rounds in measured.items()
        if (ran := [r for r in rounds if "failed" not in r])
    }
    failed = {name: [r["failed"] for r in rounds if "failed" in r] for name, rounds in measured.items()}
    results |= {
        name: {"source": f"failed in every round: {why[0]}"}
        for name, why in failed.items()
        if name not in results
    }
    results |= {s.name: {**s.quoted, **_nested(s.quoted["quoted"])} for s in line_up if s.quoted is not None}
    by_round = {}
    for name, rounds in measured.items():  # paired: the rounds both ran
        pairs = [
            (o, t)
            for o, t in zip(measured[OURS], rounds, strict=True)
            if "failed" not in o and "failed" not in t
        ]
        if name != OURS and pairs:
            by_round[name] = ratios_by_round([_figures(o) for o, _ in pairs], [_figures(t) for _, t in pairs])
    both = [(o, a) for o, a in zip(measured[OURS], measured[ALONE], strict=True) if "failed" not in o]
    overheads = [serving_overhead(o["timings"]["c1"], a["timings"]["c1"]) for o, a in both]
    served_over_alone = [o["c16"]["output_tok_per_s"] / a["c16"]["output_tok_per_s"] for o, a in both]
    offered = POISSON_RATE * statistics.fmean(a.max_tokens for a in arrivals)
    return {
        "workload": {
            "num_requests": len(arrivals),
            "seed": args.seed,
            "rounds": len(measured[ALONE]),
            "rounds_asked": args.rounds,
            "prompt_tokens": [len(a.prompt) for a in arrivals],
            "max_tokens": [a.max_tokens for a in arrivals],
            "poisson_rate_per_s": POISSON_RATE,
            "poisson_seeds": list(range(len(measured[ALONE]))),
            "poisson_offered_tok_per_s": offered,
        },
        "peers": {p.name: {"command": p.command, "source": results[p.name]["source"]} for p in peers.PEERS},
        "results": results,
        "c16_cpu": {
            name: ran[-1]["c16_cpu"]
            for name, rounds in measured.items()
            if (ran := [r for r in rounds if "c16_cpu" in r])
        },
        "failed_rounds": {name: why for name, why in failed.items() if why},
        # measured peers only: a quoted peer's figures are another run's, maybe another CPU's
        "ratios_ours_over_peer": {n: median_ratios(r) for n, r in by_round.items()},
        "ratios_by_round": by_round,
        "rounds_disagree": {n: moved for n, r in by_round.items() if (moved := disagreement(r))},
        "serving_overhead": {key: statistics.median(o[key] for o in overheads) for key in overheads[0]},
        "serving_overhead_by_round": overheads,
        "served_c16_over_engine_alone": statistics.median(served_over_alone),
        "served_c16_over_engine_alone_by_round": served_over_alone,
        "stream_counts": {s.name: s.stream_counts for s in line_up if s.stream_counts},
        "tokens_per_stream_message": {
            s.name: sum(c["tokens"] for c in s.stream_counts) / sum(c["messages"] for c in s.stream_counts)
            for s in line_up
            if s.stream_counts and all(c["messages"] for c in s.stream_counts)
        },
    }


def _nested(quoted: dict[str, float]) -> dict[str, dict[str, float]]:
    """A quoted peer's figures ("c16_tbt_p99_s") where a measured server's lie ("c16"/"tbt_p99_s")."""
    nested: dict[str, dict[str, float]] = {}
    for name, value in quoted.items():
        run, figure = name.split("_", 1)
        nested.setdefault(run, {})[figure] = value
    return nested


def _figures(round_result: dict) -> dict:
    """A round's latency summaries, without its requests' timings and its CPU split."""
    return {run: round_result[run] for run in ("c1", "c16", "poisson")}


if __name__ == "__main__":
    main()
