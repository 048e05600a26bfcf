"""The Executor of a parallel replica: drives its worker processes (parallel/worker.py;
tensor-parallel ranks or pipeline stages) and samples in the engine core from the logits of the
last worker. The core keeps what cannot cross a process boundary (grammar matchers, seeded
generators) and the penalty counts; the workers get each step's rows without them."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import subprocess
import weakref
from collections import deque
from concurrent.futures import Future
from typing import NoReturn

import torch

from replica_engine.batch_sampler import BatchSampler, StepLogits
from replica_engine.child_process import Channel, start_child
from replica_engine.config import EngineConfig
from replica_engine.executor import RunnerOutput
from replica_engine.parallel.worker import (
    READ_CLOCK,
    STOP,
    AllocateKVCache,
    Release,
    RunStep,
    StageClock,
    WorkerArgs,
    WorkerFailed,
    WorkerReady,
)
from replica_engine.persistent_batch import PersistentBatch
from replica_engine.scheduler.plan import ScheduledBatch, ScheduledRow

SHUTDOWN_TIMEOUT_S = 10


class WorkerDiedError(RuntimeError):
    """A parallel worker exited: the replica cannot run another step."""


class ParallelExecutor:
    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        """`config` resolved. Starts the workers and waits until each has its share loaded."""
        size = config.num_workers
        address = f"tcp://127.0.0.1:{_free_port()}"
        threads = max(1, torch.get_num_threads() // size)
        self._workers: list[tuple[subprocess.Popen, Channel]] = []
        self._dead: str | None = None  # why, once a worker is gone
        # Workers stop with the executor, even one never closed (a dropped LLM, a test's engine).
        weakref.finalize(self, _stop, self._workers)
        try:
            for rank in range(size):
                process, conn = start_child("replica_engine.parallel.worker")
                self._workers.append((process, conn))
                conn.send(WorkerArgs(config, rank, address, threads))
            readies = self._replies()
        except BaseException:
            self.close()
            raise
        self._num_kv_blocks = min(ready.num_kv_blocks for ready in readies if isinstance(ready, WorkerReady))
        assert config.max_num_seqs is not None and config.max_model_len is not None  # resolved
        self.rows = PersistentBatch(config.max_num_seqs, config.max_model_len, config.block_size, vocab_size)
        self.sampler = BatchSampler(self.rows)
        # Pipeline stages each hold a batch: the core submits that many before it collects.
        self.pipeline_depth = config.pipeline_parallel_size
        self._in_flight: deque[tuple[ScheduledBatch, Future[torch.Tensor] | None]] = deque()

    def num_kv_blocks(self) -> int:
        """What every worker's share of the KV budget holds (equal shares: equal counts)."""
        return self._num_kv_blocks

    def allocate_kv_cache(self, pool_size: int) -> None:
        self._broadcast(AllocateKVCache(pool_size))
        self._replies()

    def release(self, request_ids: list[str]) -> None:
        assert not self._in_flight  # (a startup profile's rows) its replies would come out of turn
        self.rows.release(request_ids)
        self._broadcast(Release(request_ids))
        self._replies()

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        self.submit(batch)
        return self.collect()

    def submit(self, batch: ScheduledBatch) -> None:
        """Send the batch to every worker; its bitmasks fill meanwhile. Workers run the batches
        they are sent in order (stage by stage, under pipeline parallelism)."""
        self._broadcast(RunStep(_for_workers(batch)))
        self._in_flight.append((batch, self.sampler.start(batch)))

    def collect(self) -> RunnerOutput:
        """The oldest batch's replies, then its tokens. The sampler's rows take each batch in
        order here, not at submit: a batch in flight still samples from what they held before."""
        batch, bitmasks = self._in_flight.popleft()
        try:
            step = self._replies()[-1]  # the last worker's: it holds the logits
        finally:
            self.sampler.settle(bitmasks)
        assert isinstance(step, StepLogits)
        self.rows.apply(batch)
        return self.sampler.finish(batch, step, bitmasks)

    def stage_busy_s(self) -> list[float]:
        """Each worker's seconds computing steps since it started (not waiting on another stage)."""
        assert not self._in_flight
        self._broadcast(READ_CLOCK)
        clocks = self._replies()
        return [clock.busy_s for clock in clocks if isinstance(clock, StageClock)]

    def close(self) -> None:
        _stop(self._workers)

    def _died(self, rank: int, process: subprocess.Popen) -> NoReturn:
        self._dead = f"parallel worker {rank} exited (code {process.poll()})"
        raise WorkerDiedError(self._dead)

    def _broadcast(self, message: object) -> None:
        if self._dead is not None:  # the others' replies are out of step now: nothing runs again
            raise WorkerDiedError(self._dead)
        for rank, (process, conn) in enumerate(self._workers):
            try:
                conn.send(message)
            except OSError:
                self._died(rank, process)

    def _replies(self) -> list[object]:
        """Every worker's reply, in rank order; the first failure raised once all have answered."""
        replies = []
        for rank, (process, conn) in enumerate(self._workers):
            try:
                replies.append(conn.recv())
            except (EOFError, OSError):
                self._died(rank, process)
        for reply in replies:
            if isinstance(reply, WorkerFailed):
                raise reply.error
        return replies


def _stop(workers: list[tuple[subprocess.Popen, Channel]]) -> None:
    for process, conn in workers:
        with contextlib.suppress(OSError):  # already gone
            conn.send(STOP)
        try:
            process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
    workers.clear()


def _for_workers(batch: ScheduledBatch) -> ScheduledBatch:
    """The rows as a worker needs them: which rows sample stays, the matchers and generators go."""

    def strip(row: ScheduledRow) -> ScheduledRow:
        if row.sampling is None:
            return row
        return dataclasses.replace(
            row, sampling=dataclasses.replace(row.sampling, generator=None, grammar=None)
        )

    return dataclasses.replace(batch, rows=tuple(strip(row) for row in batch.rows))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
