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
import json
import math
import tempfile
import threading
import time
from pathlib import Path

from bench.driver import BenchmarkRun, print_verdicts
from harness import serve_cluster
from harness.metrics_scrape import EngineCounters, wait_drained
from harness.replicas import kill_replica, wait_replaced
from harness.soak_load import client_report, outcome, run_load, soak_workload

GOALS = {
    "no_wrong_output": "no client got a wrong token count, or a token off its greedy output",
    "nothing_held_after_drain": "every replica reports no request running or waiting, no KV block held",
    "none_failed_10s_after_kill": "no request sent 10 s after the kill failed",
}


def engine_report(counters: EngineCounters) -> dict[str, float]:
    return {
        "preemptions": counters.preemptions,
        **{f"finished_{reason}": n for reason, n in counters.finished_by_reason.items()},
    }


def goals_met(report: dict) -> dict[str, bool]:
    met = {
        "no_wrong_output": "wrong_output" not in report["outcomes"],
        "nothing_held_after_drain": report["drain_s"] < math.inf,
    }
    if "kill" in report:
        met["none_failed_10s_after_kill"] = report["kill"]["failed_among_sent_10s_after"] == 0
    return met


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
    run = BenchmarkRun("soak", args.output, GOALS)

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
    app = "soak"
    config = serve_cluster.config_with_apps(work_dir / "serve_config.yaml", {app: app_args})
    cluster = serve_cluster.start(config, work_dir)
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
        cluster.wait_ready(f"/{app}")
        ray.init(address=cluster.ray_address, logging_level="ERROR", log_to_driver=False)
        url = f"{cluster.base_url}/{app}/v1/completions"
        serve_cluster.post_concurrently(url, {"prompt": [1] * 8, "max_tokens": 2}, 4)  # warm up
        before = EngineCounters.scrape(cluster, app)
        started = time.monotonic()
        wall_s, results = asyncio.run(run_load(url, requests, args.concurrency, on_finished))
        drain_s, held = wait_drained(cluster, app)
        counters = EngineCounters.scrape(cluster, app).since(before)
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

    report["engine"] = engine_report(counters)
    report["drain_s"] = drain_s  # metrics are reported every second: an upper bound
    report["held_after_drain"] = held
    print(json.dumps(report, indent=2))
    met = goals_met(report)
    print_verdicts(met)
    settings = {**vars(args), "output": str(args.output), "app_args": app_args}
    workload = "prompt 8-512 tokens log-uniform, output 1-128 uniform, ignore_eos, SSE"
    run.write({"settings": settings, "workload": workload, **report}, met)


if __name__ == "__main__":
    main()
