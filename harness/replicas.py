"""An app's engine replicas on the local cluster (its EngineReplica deployment's, or under
`ingress: colocated` its Ingress deployment's): read one's stats, find them, kill one (or its
engine core's process) as a crash would, and wait for Serve to replace it."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from harness.metrics_scrape import ENGINE_PREFIX, scrape_by_replica
from harness.serve_cluster import ServeCluster

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from replica_engine import EngineStats

STATS_TIMEOUT_S = 60  # a hang detector: the call answers in milliseconds on an idle machine


def engine_deployment(app: str) -> str:
    """The deployment whose replicas run the app's engines: EngineReplica (an app of several
    models: its first model's, EngineReplica-1), or the Ingress where the app is colocated (it
    has no EngineReplica deployment)."""
    from ray import serve

    engines = sorted(
        name for name in serve.status().applications[app].deployments if name.startswith("EngineReplica")
    )
    return engines[0] if engines else "Ingress"


def engine_stats(app: str) -> EngineStats:
    """The stats of the app's engine replica (of one of them, where it has several), through Serve."""
    from ray import serve

    handle = serve.get_deployment_handle(engine_deployment(app), app_name=app)
    return handle.stats.remote().result(timeout_s=STATS_TIMEOUT_S)


def replica_actor_names(app: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{app}#{engine_deployment(app)}#"
    actors = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in actors if a["name"].startswith(prefix))


def kill_replica(cluster: ServeCluster, app: str) -> str:
    """Kill the app's engine replica actor with the most running requests (by its last metrics
    report), as a crash would; return its actor name."""
    running = scrape_by_replica(cluster, f"{ENGINE_PREFIX}num_requests_running", {"application": app})
    names = replica_actor_names(app)
    victim = max(names, key=lambda name: running.get(name.rsplit("#", 1)[1], 0))
    kill_actor(replica_actor(victim))
    return victim


def replica_actor(name: str) -> ActorHandle:
    """A replica's actor by name (looked up ahead of a kill that must land at once: the lookup
    can take seconds on a loaded host)."""
    import ray

    return ray.get_actor(name, namespace="serve")


def kill_actor(actor: ActorHandle) -> None:
    """Kill a replica's actor, as a crash would (Serve does not restart it: it replaces it)."""
    import ray

    ray.kill(actor, no_restart=True)


def replica_pid(name: str) -> int:
    """The process of a replica's actor (on this machine: the tests' clusters are local)."""
    from ray.util.state import list_actors

    [actor] = list_actors(filters=[("actor_id", "=", replica_actor(name)._actor_id.hex())])
    return actor.pid


def kill_engine_core(app: str) -> str:
    """Kill the engine core process of the app's (first) engine replica with SIGKILL, as the
    kernel's OOM killer would; return the replica's actor name."""
    victim = replica_actor_names(app)[0]
    os.kill(_engine_core_pid(replica_pid(victim)), signal.SIGKILL)
    return victim


def _engine_core_pid(replica_pid: int) -> int:
    """The child of `replica_pid` running replica_engine.core_process (from /proc: this machine)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):  # it ended while we looked
            continue
        if parent == replica_pid and b"replica_engine.core_process" in command:
            return int(stat.parent.name)
    raise LookupError(f"replica process {replica_pid} has no engine core process")


def wait_replaced(app: str, victim: str, num_replicas: int, timeout_s: float = 300) -> float:
    """Seconds until Serve runs `num_replicas` replicas again, none of them the victim."""
    from ray import serve

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        names = replica_actor_names(app)
        deployment = serve.status().applications[app].deployments[engine_deployment(app)]
        if (
            victim not in names
            and len(names) == num_replicas
            and deployment.replica_states.get("RUNNING", 0) == num_replicas
        ):
            return time.monotonic() - started
        time.sleep(1)
    return math.inf
