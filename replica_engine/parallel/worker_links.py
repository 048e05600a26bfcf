"""How the parallel executor reaches its workers: a message goes out, its reply comes back, in
order. Two carriers, one interface: child processes of the replica over a socket
(`distributed_executor_backend: mp`, one node), or Ray actors in the replica's placement group
(`ray`, any node; parallel/ray_workers.py)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from common.ports import free_port
from replica_engine.child_process import start_child
from replica_engine.parallel.worker import STOP

SHUTDOWN_TIMEOUT_S = 10


class WorkerGoneError(RuntimeError):
    """The worker at the other end exited (or its node was lost)."""


class WorkerLink(Protocol):
    def send(self, message: object) -> None:
        """Raises WorkerGoneError."""

    def recv(self) -> object:
        """The reply to the oldest message not yet answered; raises WorkerGoneError."""

    def stop(self) -> None:
        """Ask it to leave its process group and exit; kill it if it does not in time."""


class ProcessLink:
    """A worker process of this node (python -m replica_engine.parallel.worker)."""

    def __init__(self) -> None:
        self.process, self._conn = start_child("replica_engine.parallel.worker")

    def send(self, message: object) -> None:
        try:
            self._conn.send(message)
        except OSError as error:
            raise self._gone() from error

    def recv(self) -> object:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as error:
            raise self._gone() from error

    def _gone(self) -> WorkerGoneError:
        return WorkerGoneError(f"exited (code {self.process.poll()})")

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # already gone
            self._conn.send(STOP)
        try:
            self.process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()


@dataclass
class StartedWorkers:
    links: list[WorkerLink]  # by rank
    address: str  # the process group's rendezvous, tcp://host:port
    num_threads: int  # torch threads per worker
    gpu_of_rank: Callable[[int], int]  # which of its visible GPUs a worker uses
    release: Callable[[], None] | None = None  # once they are stopped: what else to give back


def start_processes(size: int, num_threads: int) -> StartedWorkers:
    """`size` worker processes here, sharing `num_threads`; the rendezvous on this host. The
    replica sees every worker's GPU: worker r uses the r-th."""
    links: list[WorkerLink] = []
    try:
        for _ in range(size):
            links.append(ProcessLink())
    except BaseException:
        stop_all(links)
        raise
    threads = max(1, num_threads // size)
    return StartedWorkers(links, f"tcp://127.0.0.1:{free_port()}", threads, gpu_of_rank=lambda rank: rank)


def stop_all(links: list[WorkerLink]) -> None:
    for link in links:
        link.stop()
    links.clear()
