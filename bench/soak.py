"""Soak: streaming requests at a fixed concurrency, some clients hanging up mid-stream, and one
EngineReplica killed mid-load, on a real local Ray cluster. Writes a JSON report.

    python -m bench.soak [--requests 1000] [--concurrency 64] [--disconnect-fraction 0.1]
                         [--kill-after 0.5] [--model smollm2-135m-instruct] [--seed 0]

Each request is a random-token prompt of 8-512 tokens (log-uniform) asking for 1-128 greedy
tokens (uniform) with ignore_eos, so a completed request must return exactly max_tokens tokens
(and, where the expected outputs were computed offline, as tests/serve/test_load.py does, exactly those
tokens: a hang-up must have received a prefix of them). A
client picked to hang up does so after a random number of chunks. Once `--kill-after` of the
requests have ended, one of the app's two replicas is killed as a crash would (ray.kill); Serve
starts another. The report: requests sent, each outcome (completed, disconnected, failed by
error code, wrong output), the engines' finished-by-reason counters, preemptions, KV blocks
still held and requests still running after the drain, and client-side TTFT and TBT."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from bench import serve_cluster
from bench.serve_cluster import ServeCluster
from bench.sse_client import StreamResult, stream_completion
from bench.workload import percentile, result_header

METRIC = "ray_stallfree_"
DRAIN_TIMEOUT_S = 30


@dataclass(frozen=True)
class SoakRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    disconnect_after_chunks: int | None = None  # the client hangs up after this many chunks
    expected_token_ids: list[int] | None = None  # greedy output computed offline, where known


def with_expected_outputs(requests: list[SoakRequest], model: str) -> list[SoakRequest]:
    """The same requests, each knowing its greedy output from the offline engine in float32 (every
    request is greedy; in fp32 our CPU engine's rows do not depend on their batch mates, so the
    server must run float32 too)."""
    from replica_engine import LLM, SamplingParams

    outputs = LLM(model, dtype="float32").generate(
        [r.prompt_token_ids for r in requests],
        [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests],
    )
    return [
        dataclasses.replace(request, expected_token_ids=output.token_ids)
        for request, output in zip(requests, outputs, strict=True)
    ]


def soak_workload(
    num_requests: int,
    vocab_size: int,
    disconnect_fraction: float,
    seed: int,
    prompt_range: tuple[int, int] = (8, 512),
    output_range: tuple[int, int] = (1, 128),
) -> list[SoakRequest]:
    rng = random.Random(seed)
    log_lo, log_hi = math.log(prompt_range[0]), math.log(prompt_range[1])
    requests = []
    for _ in range(num_requests):
        prompt_len = round(math.exp(rng.uniform(log_lo, log_hi)))
        max_tokens = rng.randint(*output_range)
        hangs_up = max_tokens > 1 and rng.random() < disconnect_fraction
        requests.append(
            SoakRequest(
                [rng.randrange(vocab_size) for _ in range(prompt_len)],
                max_tokens,
                rng.randint(1, max_tokens - 1) if hangs_up else None,
            )
        )
    return requests


def outcome(request: SoakRequest, result: StreamResult) -> str:
    """completed, disconnected, failed:<code>, or wrong_output: a count off, or (where the
    expected output is known) a token that differs, even before a hang-up."""
    expected = request.expected_token_ids
    if expected is not None and result.token_ids != expected[: len(result.token_ids)]:
        return "wrong_output"
    if result.disconnected:
        return "disconnected"
    if result.status != 200 or result.error_code is not None:
        return f"failed:{result.error_code}"
    counted = result.completion_tokens == request.max_tokens and result.finish_reason == "length"
    if counted and (expected is None or result.token_ids == expected):
        return "completed"
    return "wrong_output"


async def run_load(
    url: str,
    requests: list[SoakRequest],
    concurrency: int,
    on_finished: Callable[[int], None] | None = None,
) -> tuple[float, list[StreamResult]]:
    """Send every request, at most `concurrency` at once; `on_finished(count)` after each ends."""
    semaphore = asyncio.Semaphore(concurrency)
    num_finished = 0

    async def one(http: httpx.AsyncClient, request: SoakRequest) -> StreamResult:
        nonlocal num_finished
        body = {
            "prompt": request.prompt_token_ids,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        async with semaphore:
            try:
                result = await stream_completion(http, url, body, request.disconnect_after_chunks)
            except httpx.HTTPError as error:  # counted, not raised: the report says what happened
                result = StreamResult(status=0, error_code=f"client:{type(error).__name__}")
        num_finished += 1
        if on_finished is not None:
            on_finished(num_finished)
        return result

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        started = time.monotonic()
        results = await asyncio.gather(*(one(http, r) for r in requests))
        return time.monotonic() - started, list(results)


def client_report(requests: list[SoakRequest], results: list[StreamResult], wall_s: float) -> dict:
    outcomes = Counter(outcome(r, res) for r, res in zip(requests, results, strict=True))
    completed = [res for r, res in zip(requests, results, strict=True) if outcome(r, res) == "completed"]
    ttft = [res.ttft_s for res in completed]
    gaps = [gap for res in completed for gap in res.chunk_gaps_s]
    return {
        "requests_sent": len(requests),
        "disconnects_planned": sum(r.disconnect_after_chunks is not None for r in requests),
        "outcomes": dict(sorted(outcomes.items())),
        "wall_s": round(wall_s, 2),
        "output_tokens_completed": sum(res.completion_tokens for res in completed),
        "ttft_p50_s": percentile(ttft, 0.5) if ttft else None,
        "ttft_p99_s": percentile(ttft, 0.99) if ttft else None,
        "tbt_p99_s": percentile(gaps, 0.99) if gaps else None,  # between chunks of one stream
    }


def engine_counters(cluster: ServeCluster, app: str) -> dict[str, float]:
    labels = {"application": app}
    counters = {"preemptions": serve_cluster.scrape(cluster, f"{METRIC}num_preemptions_total", labels)}
    for reason in ("length", "stop", "abort", "error"):
        finished = {**labels, "finished_reason": reason}
        counters[f"finished_{reason}"] = serve_cluster.scrape(
            cluster, f"{METRIC}requests_finished_total", finished
        )
    return counters


def held_after_drain(cluster: ServeCluster, app: str) -> dict[str, dict[str, float]]:
    """Per live replica: requests running or waiting, and KV blocks still held."""
    labels = {"application": app}

    def gauge(name: str) -> dict[str, float]:
        return serve_cluster.scrape_by_replica(cluster, f"{METRIC}{name}", labels)

    running, waiting = gauge("num_requests_running"), gauge("num_requests_waiting")
    free, usage = gauge("num_free_kv_blocks"), gauge("kv_cache_usage_perc")
    held = {}
    for replica in free:
        used = round(free[replica] * usage[replica] / (1 - usage[replica])) if usage[replica] < 1 else -1
        held[replica] = {
            "running": running.get(replica, 0),
            "waiting": waiting.get(replica, 0),
            "kv_blocks_held": used,  # -1: every block
        }
    return held


def wait_drained(cluster: ServeCluster, app: str) -> tuple[float, dict[str, dict[str, float]]]:
    """Until every replica reports nothing running, waiting or held (or the timeout)."""
    started = time.monotonic()
    while True:
        held = held_after_drain(cluster, app)
        if held and all(not any(values.values()) for values in held.values()):
            return time.monotonic() - started, held
        if time.monotonic() - started > DRAIN_TIMEOUT_S:
            return math.inf, held
        time.sleep(0.5)


def replica_actor_names(app: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{app}#EngineReplica#"
    actors = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in actors if a["name"].startswith(prefix))


def kill_replica(cluster: ServeCluster, app: str) -> str:
    """Kill the app's EngineReplica actor with the most running requests (by its last metrics
    report), as a crash would; return its actor name."""
    import ray

    running = serve_cluster.scrape_by_replica(cluster, f"{METRIC}num_requests_running", {"application": app})
    names = replica_actor_names(app)
    victim = max(names, key=lambda name: running.get(name.rsplit("#", 1)[1], 0))
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    return victim


def wait_replaced(app: str, victim: str, num_replicas: int, timeout_s: float = 300) -> float:
    """Seconds until Serve runs `num_replicas` replicas again, none of them the victim."""
    from ray import serve

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        names = replica_actor_names(app)
        deployment = serve.status().applications[app].deployments["EngineReplica"]
        if (
            victim not in names
            and len(names) == num_replicas
            and deployment.replica_states.get("RUNNING", 0) == num_replicas
        ):
            return time.monotonic() - started
        time.sleep(1)
    return math.inf


def _config(path: Path, app_args: dict) -> Path:
    config = yaml.safe_load((serve_cluster.REPO / "serve_config.yaml").read_text())
    app = config["applications"][0]
    app["args"] = {**app["args"], **app_args}
    path.write_text(yaml.safe_dump(config))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument("--kill-after", type=float, default=0.5, help="fraction ended; 0: no kill")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="KV pool per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("bench/results/soak_cpu.json"))
    args = parser.parse_args()

    import ray

    from common.model_source import resolve_model
    from replica_engine.models.loader import load_config

    num_replicas = 2
    app_args = {
        "model": args.model,
        "num_replicas": num_replicas,
        "num_cpus": 0,
        "cpu_threads": 1,
        "engine": {"kv_cache_bytes": args.kv_cache_mib << 20, "max_num_seqs": args.concurrency},
    }
    vocab_size = load_config(resolve_model(args.model)).vocab_size
    requests = soak_workload(args.requests, vocab_size, args.disconnect_fraction, args.seed)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    cluster = serve_cluster.start(_config(work_dir / "serve_config.yaml", app_args), work_dir)
    app = cluster.app_name
    kill: dict[str, object] = {}
    watcher: list[threading.Thread] = []  # times Serve's replacement of the killed replica

    def watch_replacement(victim: str) -> None:
        kill["replaced_after_s"] = round(wait_replaced(app, victim, num_replicas), 1)

    def on_finished(count: int) -> None:
        if args.kill_after and count == int(args.kill_after * len(requests)):
            kill["at_s"] = time.monotonic()
            kill["victim"] = kill_replica(cluster, app)
            watcher.append(threading.Thread(target=watch_replacement, args=(kill["victim"],)))
            watcher[0].start()

    try:
        cluster.wait_ready()
        ray.init(address=cluster.ray_address, logging_level="ERROR", log_to_driver=False)
        url = f"{cluster.base_url}/v1/completions"
        serve_cluster.post_concurrently(url, {"prompt": [1] * 8, "max_tokens": 2}, 4)  # warm up
        before = engine_counters(cluster, app)
        started = time.monotonic()
        wall_s, results = asyncio.run(run_load(url, requests, args.concurrency, on_finished))
        drain_s, held = wait_drained(cluster, app)
        counters = engine_counters(cluster, app)
        report = client_report(requests, results, wall_s)
        if kill:
            watcher[0].join()
            kill_at = float(kill["at_s"])  # type: ignore[arg-type]
            report["kill"] = {
                "victim": kill["victim"],
                "at_s": round(kill_at - started, 2),
                "replaced_after_s": kill["replaced_after_s"],  # a new replica RUNNING, from the kill
                # Requests sent 10 s after the kill (Serve has noticed by then) must all succeed.
                "failed_among_sent_10s_after": sum(
                    outcome(r, res).startswith("failed")
                    for r, res in zip(requests, results, strict=True)
                    if res.sent_at > kill_at + 10
                ),
            }
    finally:
        ray.shutdown()
        serve_cluster.stop(cluster)

    report["engine"] = {key: counters[key] - before[key] for key in counters}
    report["drain_s"] = drain_s  # metrics are reported every second: an upper bound
    report["held_after_drain"] = held
    print(json.dumps(report, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    result = {
        **result_header("soak"),
        "settings": {**vars(args), "output": str(args.output), "app_args": app_args},
        "workload": "prompt 8-512 tokens log-uniform, output 1-128 uniform, ignore_eos, SSE",
        **report,
    }
    args.output.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
