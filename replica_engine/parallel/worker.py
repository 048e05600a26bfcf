"""One parallel worker: a process holding its share of the model (its heads, or its pipeline
stage's layers) and that share's KV cache, started by parallel/executor.py as
`python -m replica_engine.parallel.worker FD` (or as a Ray actor: parallel/ray_workers.py). It
joins the replica's process group, says how many KV blocks fit, then runs every step it is sent.
All workers run each step (their collectives keep them in lock step); only the last sends the
step's logits back. A collective that waits on a dead worker gives up after
COLLECTIVE_TIMEOUT_S, so no worker hangs for ever."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from common.model_source import resolve_model
from replica_engine.batch_sampler import StepLogits
from replica_engine.child_process import Channel
from replica_engine.config import EngineConfig
from replica_engine.model_runner import ModelRunner, load_runner
from replica_engine.models.loader import load_config
from replica_engine.parallel.place import WorkerPlace
from replica_engine.scheduler.plan import ScheduledBatch

COLLECTIVE_TIMEOUT_S = 60


@dataclass(frozen=True)
class WorkerArgs:
    config: EngineConfig  # the replica's, resolved
    rank: int
    address: str  # the process group's rendezvous, tcp://host:port
    num_threads: int
    gpu: int  # which of the GPUs this worker sees is its own (on a GPU)

    @property
    def place(self) -> WorkerPlace:
        return WorkerPlace(
            self.rank,
            self.config.tensor_parallel_size,
            self.config.pipeline_parallel_size,
            self.config.enable_expert_parallel,
        )


@dataclass(frozen=True)
class WorkerReady:
    num_kv_blocks: int


@dataclass(frozen=True)
class WorkerFailed:
    error: BaseException

    @classmethod
    def of(cls, rank: int, error: BaseException) -> WorkerFailed:
        return cls(RuntimeError(f"parallel worker {rank}: {error!r}"))


@dataclass(frozen=True)
class AllocateKVCache:
    pool_size: int


@dataclass(frozen=True)
class Release:
    request_ids: list[str]


@dataclass(frozen=True)
class RunStep:
    batch: ScheduledBatch  # without grammars or generators: sampling is the executor's


@dataclass(frozen=True)
class StageClock:
    busy_s: float  # computing steps since the worker started, not waiting on another stage


STOP = "stop"
READ_CLOCK = "read clock"


def build_runner(args: WorkerArgs) -> ModelRunner:
    config, place = args.config, args.place
    on_gpu = config.torch_device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(args.gpu)
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=args.address,
        rank=args.rank,
        world_size=place.world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    # The replica's KV budget, split: each worker holds its own KV heads or layers for every block.
    own_bytes = config.kv_cache_bytes // place.world_size if config.kv_cache_bytes is not None else None
    source = resolve_model(config.model)
    own_config = dataclasses.replace(config, kv_cache_bytes=own_bytes)
    return load_runner(source, load_config(source), own_config, place)


class Worker:
    """One worker's share of the model and what it does with each message, whatever carries them
    (a socket from the executor: main below; Ray's actor calls: parallel/ray_workers.py)."""

    def __init__(self, args: WorkerArgs) -> None:
        torch.set_num_threads(args.num_threads)
        self.args = args
        self.runner = build_runner(args)
        self.busy_s = 0.0  # computing steps, waits on another stage left out

    def handle(self, message: object) -> object:
        """The reply to one message; a failure is a WorkerFailed reply (the step fails in the
        executor; the worker lives on)."""
        try:
            if isinstance(message, AllocateKVCache):
                self.runner.allocate_kv_cache(message.pool_size)
            elif isinstance(message, Release):
                self.runner.release(message.request_ids)
            elif message == READ_CLOCK:
                return StageClock(self.busy_s)
            else:
                assert isinstance(message, RunStep)
                return self._run(message.batch)
        except Exception as error:
            return WorkerFailed.of(self.args.rank, error)
        return None

    def _run(self, batch: ScheduledBatch) -> StepLogits | None:
        started, waited = time.perf_counter(), self._waited_s()
        step = self.runner.forward(batch)
        self.busy_s += time.perf_counter() - started - (self._waited_s() - waited)
        return step if self.args.place.holds_logits else None

    def _waited_s(self) -> float:
        stage = self.runner.model.stage
        return stage.waited_s if stage is not None else 0.0

    @staticmethod
    def stop() -> None:
        dist.destroy_process_group()


def start_worker(args: WorkerArgs) -> tuple[Worker | None, WorkerReady | WorkerFailed]:
    try:
        worker = Worker(args)
    except BaseException as error:
        return None, WorkerFailed.of(args.rank, error)
    return worker, WorkerReady(worker.runner.num_kv_blocks())


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the replica's to handle
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s parallel-worker %(name)s: %(message)s"
    )
    conn = Channel(fd)
    args = conn.recv()
    assert isinstance(args, WorkerArgs)
    worker, ready = start_worker(args)
    conn.send(ready)
    if worker is None:
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the executor is gone
            return
        if message == STOP:
            worker.stop()
            return
        conn.send(worker.handle(message))


if __name__ == "__main__":
    # By its importable name: what it unpickles must name `replica_engine.parallel.worker`.
    from replica_engine.parallel.worker import main as worker_main

    worker_main(int(sys.argv[1]))
    os._exit(0)  # no waiting on non-daemon threads a library may have left
