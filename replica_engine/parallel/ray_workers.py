"""Parallel workers as Ray actors (`distributed_executor_backend: ray`): one per bundle of the
replica's placement group, so that a replica's workers may sit on other nodes than the replica
(Serve reserves the group: deployments/app.py, PACK, SPREAD or STRICT_PACK). Without a current
placement group (an offline LLM in a Ray driver) the executor reserves its own, one bundle per
worker. The process group's rendezvous is on worker 0's node. Ray runs one caller's calls to an
actor in order, so replies come back as a socket's would."""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.ports import free_port
from replica_engine.parallel.worker import STOP, Worker, WorkerArgs, WorkerFailed, WorkerReady, start_worker
from replica_engine.parallel.worker_links import (
    SHUTDOWN_TIMEOUT_S,
    StartedWorkers,
    WorkerGoneError,
    WorkerLink,
)

PLACEMENT_TIMEOUT_S = 120  # an own placement group the cluster cannot hold fails, naming the setting


class RayWorker:
    """The actor: a Worker, started once the process group's address is known."""

    def __init__(self) -> None:
        logging.basicConfig(level=logging.INFO)
        self.worker: Worker | None = None

    def rendezvous_address(self) -> str:
        return f"tcp://{ray.util.get_node_ip_address()}:{free_port('')}"

    def start(self, args: WorkerArgs) -> WorkerReady | WorkerFailed:
        self.worker, ready = start_worker(args)
        return ready

    def handle(self, message: object) -> object:
        assert self.worker is not None
        if message == STOP:
            self.worker.stop()
            return None
        return self.worker.handle(message)


class RayLink:
    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._replies: deque[Any] = deque()  # ObjectRefs, oldest first

    def send(self, message: object) -> None:
        method = self.actor.start if isinstance(message, WorkerArgs) else self.actor.handle
        self._replies.append(method.remote(message))

    def recv(self) -> object:
        try:
            return ray.get(self._replies.popleft())
        except RayActorError as error:
            raise WorkerGoneError(f"lost (its Ray actor died: {type(error).__name__})") from error

    def stop(self) -> None:
        with contextlib.suppress(Exception):  # gone, or stuck in a collective with a dead one
            ray.get(self.actor.handle.remote(STOP), timeout=SHUTDOWN_TIMEOUT_S)
        ray.kill(self.actor)


def start_actors(size: int) -> StartedWorkers:
    """`size` actors, one per bundle; the rendezvous on worker 0's node; as many torch threads
    each as its bundle has CPUs."""
    group, first, own = _placement(size)
    links: list[WorkerLink] = []
    for rank in range(size):
        bundle = group.bundle_specs[first + rank]
        actor = (
            ray.remote(RayWorker)
            .options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, first + rank),
            )
            .remote()
        )
        links.append(RayLink(actor))
    address = ray.get(links[0].actor.rendezvous_address.remote())  # type: ignore[attr-defined]
    threads = max(1, int(group.bundle_specs[first].get("CPU", 1)))
    release = (lambda: ray.util.remove_placement_group(group)) if own else None
    # A Ray actor sees only its own GPUs: each worker's is its first.
    return StartedWorkers(links, address, threads, gpu_of_rank=lambda rank: 0, release=release)


def _placement(size: int) -> tuple[PlacementGroup, int, bool]:
    """The replica's placement group and the first workers' bundle (0 is the replica's own), or
    a group of our own (True)."""
    group = get_current_placement_group()
    if group is not None:
        if len(group.bundle_specs) < size + 1:
            raise ValueError(
                f"distributed_executor_backend: ray needs a bundle per worker after the replica's;"
                f" the placement group has {len(group.bundle_specs)} for {size} workers"
            )
        return group, 1, False
    group = placement_group([{"CPU": 1}] * size, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ValueError(
            f"distributed_executor_backend: ray could not place {size} workers of 1 CPU in"
            f" {PLACEMENT_TIMEOUT_S} s"
        )
    return group, 0, True
