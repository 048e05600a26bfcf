"""Soak: streaming requests at a fixed concurrency, some clients hanging up mid-stream, and a fault
mid-load, on a real local Ray cluster. Writes a JSON report.

    python -m bench soak [--requests 1000] [--concurrency 64] [--disconnect-fraction 0.1]
                         [--kill-after 0.5] [--model smollm2-135m-instruct] [--seed 0]
                         [--nodes 3] [--check-tokens]

Each request is a random-token prompt of 8-512 tokens (log-uniform) asking for 1-128 greedy
tokens (uniform) with ignore_eos, so a completed request must return exactly max_tokens tokens;
with --check-tokens (on with --nodes), also exactly the tokens the offline engine computes in
float32 (the app runs float32 too), and a hang-up a prefix of them. A client picked to hang up
does so after a random number of chunks. Once `--kill-after` of the requests have ended:

- one node (default): one of the app's two replicas is killed as a crash would (ray.kill);
- `--nodes 3`: a real multi-node cluster (harness/multinode_cluster.py: a head and two worker
  nodes, one replica pinned to each worker, a spare slot on worker-2, an Ingress and a proxy per
  node); worker-1 is lost, its raylet and every process on it killed. Clients enter through the
  head's proxy.

Serve starts a replacement. The report: requests sent, each outcome (completed, disconnected,
failed by error code, wrong output), clients that never got an end (hung), the engines'
finished-by-reason counters, preemptions, KV blocks still held and requests still running after
the drain, when the fleet was whole again, failures among requests sent after that, and
client-side TTFT and TBT."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.driver import BenchmarkRun, print_verdicts
from harness import multinode_cluster, serve_cluster
from harness.metrics_scrape import EngineCounters, MetricsSource, replicas_reporting, wait_drained
from harness.replicas import kill_replica, wait_replaced
from harness.soak_load import client_report, outcome, run_load, soak_workload, with_expected_outputs

NUM_REPLICAS = 2
GOALS = {
    "no_wrong_output": "no client got a wrong token count, or a token off its greedy output",
    "nothing_held_after_drain": "every replica reports no request running or waiting, no KV block held",
    "none_hung": "every client got its last chunk, its error, or its hang-up",
    "none_failed_after_replacement": "no request sent after the replacement was running failed",
}


@dataclass
class Fault:
    """What was broken, when (monotonic), and when the fleet was whole again."""

    victim: str
    at: float
    whole_at: float = math.inf


class OneNode:
    """serve_config.yaml's app on a one-node cluster; the fault kills a replica actor."""

    def __init__(self, app_args: dict, work_dir: Path) -> None:
        self.app = "soak"
        config = serve_cluster.config_with_apps(work_dir / "serve_config.yaml", {self.app: app_args})
        self.cluster = serve_cluster.start(config, work_dir)
        self.metrics: MetricsSource = self.cluster

    def ready(self) -> str:
        import ray

        self.cluster.wait_ready(f"/{self.app}")
        ray.init(address=self.cluster.ray_address, logging_level="ERROR", log_to_driver=False)
        return f"{self.cluster.base_url}/{self.app}/v1/completions"

    def break_one(self) -> str:
        return kill_replica(self.cluster, self.app)

    def wait_whole(self, victim: str) -> None:
        wait_replaced(self.app, victim, NUM_REPLICAS)

    def stop(self) -> None:
        import ray

        ray.shutdown()
        serve_cluster.stop(self.cluster)


class ThreeNodes:
    """The same app on a head and two worker nodes; the fault loses worker-1 whole."""

    def __init__(self, app_args: dict, work_dir: Path) -> None:
        self.app = "stallfree"
        self.cluster = multinode_cluster.start_app(app_args, work_dir)
        self.metrics = self.cluster.node_named("worker-2")  # the survivor: both replicas end there

    def ready(self) -> str:
        self.cluster.wait_ready()
        return f"{self.cluster.head.http_url}/v1/completions"

    def break_one(self) -> str:
        self.cluster.remove_worker(self.cluster.node_named("worker-1"))
        return "worker-1"

    def wait_whole(self, victim: str, timeout_s: float = 300) -> None:
        """Until the survivor's export port shows both replicas (the replacement's gauges appear
        once it runs)."""
        deadline = time.monotonic() + timeout_s
        while len(replicas_reporting(self.metrics, self.app)) < NUM_REPLICAS:
            if time.monotonic() > deadline:
                return
            time.sleep(0.5)

    def stop(self) -> None:
        multinode_cluster.stop(self.cluster)


def goals_met(report: dict) -> dict[str, bool]:
    met = {
        "no_wrong_output": "wrong_output" not in report["outcomes"],
        "nothing_held_after_drain": report["drain_s"] < math.inf,
        "none_hung": report["hung"] == 0,
    }
    if "fault" in report:
        fault = report["fault"]  # judged only if requests were sent after the fleet was whole
        met["none_failed_after_replacement"] = (
            fault["sent_after_whole"] > 0 and not fault["failed_among_sent_after_whole"]
        )
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument("--kill-after", type=float, default=0.5, help="fraction ended; 0: no fault")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="KV pool per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nodes", type=int, choices=(1, 3), default=1)
    parser.add_argument("--check-tokens", action="store_true", help="on with --nodes 3")
    parser.add_argument("--output", type=Path, help="default: bench/results/soak_cpu[_multinode].json")
    args = parser.parse_args()
    args.check_tokens = args.check_tokens or args.nodes > 1
    args.output = args.output or Path(f"bench/results/soak_cpu{'_multinode' if args.nodes > 1 else ''}.json")
    run = BenchmarkRun("soak", args.output, GOALS)

    from common.model_source import resolve_model
    from replica_engine.models.loader import load_config

    engine = {"kv_cache_bytes": args.kv_cache_mib << 20, "max_num_seqs": args.concurrency}
    if args.check_tokens:
        engine["dtype"] = "float32"  # as the offline engine computes the expected tokens
    app_args = {
        "model": args.model,
        "num_replicas": NUM_REPLICAS,
        "num_cpus": 0,
        "cpu_threads": 1,
        "engine": engine,
    }
    vocab_size = load_config(resolve_model(args.model)).vocab_size
    requests = soak_workload(args.requests, vocab_size, args.disconnect_fraction, args.seed)
    if args.check_tokens:
        requests = with_expected_outputs(requests, args.model)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    fleet = (ThreeNodes if args.nodes > 1 else OneNode)(app_args, work_dir)
    faults: list[Fault] = []
    watcher: list[threading.Thread] = []

    def watch_replacement(fault: Fault) -> None:
        fleet.wait_whole(fault.victim)
        fault.whole_at = time.monotonic()

    def on_finished(count: int) -> None:
        if args.kill_after and count == int(args.kill_after * len(requests)):
            faults.append(Fault(fleet.break_one(), time.monotonic()))
            watcher.append(threading.Thread(target=watch_replacement, args=(faults[0],)))
            watcher[0].start()

    try:
        url = fleet.ready()
        serve_cluster.post_concurrently(url, {"prompt": [1] * 8, "max_tokens": 2}, 4)  # warm up
        before = EngineCounters.scrape(fleet.metrics, fleet.app)
        started = time.monotonic()
        wall_s, results = asyncio.run(run_load(url, requests, args.concurrency, on_finished))
        for thread in watcher:  # the replacement too must drain
            thread.join()
        drain_s, held = wait_drained(fleet.metrics, fleet.app)
        counters = EngineCounters.scrape(fleet.metrics, fleet.app).since(before)
        report = client_report(requests, results, wall_s)
        outcomes = [outcome(r, res) for r, res in zip(requests, results, strict=True)]
        report["hung"] = sum(o.startswith("failed:client:") and "Timeout" in o for o in outcomes)
        if faults:
            fault = faults[0]
            after_whole = [
                o for o, res in zip(outcomes, results, strict=True) if res.sent_at > fault.whole_at
            ]
            report["fault"] = {
                "victim": fault.victim,
                "at_s": round(fault.at - started, 2),
                "whole_after_s": round(fault.whole_at - fault.at, 1),  # a replacement serving, from the fault
                "sent_after_whole": len(after_whole),
                "failed_among_sent_after_whole": sum(o.startswith("failed") for o in after_whole),
            }
    finally:
        fleet.stop()

    report["engine"] = {  # one node: every replica; three: the survivor's (the lost node's went with it)
        "preemptions": counters.preemptions,
        **{f"finished_{reason}": n for reason, n in counters.finished_by_reason.items()},
    }
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
