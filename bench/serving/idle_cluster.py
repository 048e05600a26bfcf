"""`python -m bench idle_cluster`: what a served cluster costs the cores while no request comes.
A one-node cluster serving serve_config.yaml (the replica, Serve's controller and proxy, HAProxy,
Ray's GCS, raylet, dashboard and agents), as the benchmarks start it, at Serve's default control
loop (ten times a second) and at the shipped one (RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5, which
`make serve` sets), in interleaved rounds (default, shipped, default, shipped). Each run waits
for the app, lets it settle, then reads the CPU seconds of every process of the cluster's session
over a window: only the cluster's own processes are counted, so the machine may be busy with
other work. On 2 cores each wake-up of these processes takes a core from one of a step's two
threads. Writes bench/results/idle_cluster.json; about 6 minutes, not part of make test."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

from bench.driver import BenchmarkRun, Spread, print_verdicts
from bench.serving.cpu_split import cpu_seconds
from harness import serve_cluster

DEFAULT, SHIPPED = "Serve's default loop (0.1 s)", "shipped (0.5 s)"
SYSTEMS = {DEFAULT: {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}, SHIPPED: {}}
CONTROLLER = "ServeController"
SETTLE_S = 15
WINDOW_S = 30
GOALS = {"controller_cpu_vs_serve_default_max": 0.5, "cluster_cpu_vs_serve_default_max": 0.85}


def session_cpu_seconds(session_id: int) -> dict[int, tuple[str, float]]:
    """The cluster's own processes only: those of its session."""
    processes = []
    for pid in serve_cluster.session_pids(session_id):
        with contextlib.suppress(psutil.NoSuchProcess):
            processes.append(psutil.Process(pid))
    return cpu_seconds(processes)


def idle_run(env: dict[str, str], window_s: float) -> dict[str, object]:
    """CPU milliseconds per second of the idle cluster, in all and per process group."""
    log_dir = Path(tempfile.mkdtemp(prefix="idle_cluster-"))
    cluster = serve_cluster.start(
        serve_cluster.SHIPPED_CONFIG, log_dir, env=env, cluster_env=serve_cluster.BENCH_CLUSTER_ENV
    )
    try:
        cluster.wait_ready()
        time.sleep(SETTLE_S)
        before, started = session_cpu_seconds(cluster.session_id), time.monotonic()
        time.sleep(window_s)
        after, wall_s = session_cpu_seconds(cluster.session_id), time.monotonic() - started
    finally:
        serve_cluster.stop(cluster)
    by_group: Counter[str] = Counter()
    for pid, (group, seconds) in after.items():
        if pid in before:
            by_group[group] += seconds - before[pid][1]
    per_s = {group: round(1000 * seconds / wall_s, 2) for group, seconds in by_group.most_common()}
    return {
        "total_ms_per_s": round(sum(per_s.values()), 2),
        "controller_ms_per_s": per_s.get(CONTROLLER, 0.0),
        "by_process_ms_per_s": per_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-s", type=float, default=WINDOW_S)
    parser.add_argument("--output", type=Path, default=Path("bench/results/idle_cluster.json"))
    args = parser.parse_args()
    run = BenchmarkRun("idle_cluster", args.output, GOALS)
    runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    for round_index in range(args.rounds):
        for name, env in SYSTEMS.items():
            result = idle_run(env, args.window_s)
            runs[name].append(result)
            print(
                f"round {round_index} {name}: cluster {result['total_ms_per_s']:.1f} ms CPU/s, "
                f"controller {result['controller_ms_per_s']:.1f}",
                flush=True,
            )
    controller = Spread.of_ratios(runs[SHIPPED], runs[DEFAULT], "controller_ms_per_s")
    cluster = Spread.of_ratios(runs[SHIPPED], runs[DEFAULT], "total_ms_per_s")
    print(f"shipped / Serve's default: controller {controller:.2f}, cluster {cluster:.2f}")
    goals_met = {
        "controller_cpu_vs_serve_default_max": controller.median
        <= GOALS["controller_cpu_vs_serve_default_max"],
        "cluster_cpu_vs_serve_default_max": cluster.median <= GOALS["cluster_cpu_vs_serve_default_max"],
    }
    print_verdicts(goals_met)
    body = {
        "settings": {
            "rounds": args.rounds,
            "settle_s": SETTLE_S,
            "window_s": args.window_s,
            "systems": SYSTEMS,
        },
        "systems": {
            name: {
                "total_ms_per_s": vars(Spread.of_runs(results, "total_ms_per_s")),
                "controller_ms_per_s": vars(Spread.of_runs(results, "controller_ms_per_s")),
            }
            for name, results in runs.items()
        },
        "shipped_vs_default": {"controller": vars(controller), "cluster": vars(cluster)},
        "runs": runs,
    }
    run.write(body, goals_met)


if __name__ == "__main__":
    main()
