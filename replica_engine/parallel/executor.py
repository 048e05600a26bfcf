"""The Executor of a parallel replica: drives its worker processes (parallel/worker.py;
tensor-parallel ranks or pipeline stages) and samples in the engine core from the logits of the
last worker. The core keeps what cannot cross a process boundary (grammar matchers, seeded
generators) and the penalty counts; the workers get each step's rows without them."""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from replica_engine.batch_sampler import BatchSampler, StepLogits
from replica_engine.config import EngineConfig
from replica_engine.executor import RunnerOutput
from replica_engine.parallel.worker import (
    READ_CLOCK,
    AllocateKVCache,
    Release,
    RunStep,
    StageClock,
    WorkerArgs,
    WorkerFailed,
    WorkerReady,
)
from replica_engine.parallel.worker_links import WorkerGoneError, WorkerLink, start_processes, stop_all
from replica_engine.persistent_batch import PersistentBatch
from replica_engine.scheduler.plan import ScheduledBatch, ScheduledRow


class WorkerDiedError(RuntimeError):
    """A parallel worker exited: the replica cannot run another step."""


class ParallelExecutor:
    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        """`config` resolved. Starts the workers (processes here, or Ray actors) and waits until
        each has its share loaded."""
        size = config.num_workers
        if config.distributed_executor_backend == "ray":
            from replica_engine.parallel.ray_workers import start_actors  # Ray only when asked

            started = start_actors(size)
        else:
            started = start_processes(size, torch.get_num_threads())
        self._workers = started.links
        self._dead: str | None = None  # why, once a worker is gone
        # Workers stop with the executor, even one never closed (a dropped LLM, a test's engine).
        self._finalizer = weakref.finalize(self, _stop, self._workers, started.release)
        try:
            for rank, link in enumerate(self._workers):
                link.send(
                    WorkerArgs(config, rank, started.address, started.num_threads, started.gpu_of_rank(rank))
                )
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
        self.schedules_ahead = False  # the workers would need the core's sampled tokens
        self.kv_layout = None  # each worker holds part of each block: no blocks move between replicas
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
        return self.sampler.finish(batch, step, bitmasks).result()

    def stage_busy_s(self) -> list[float]:
        """Each worker's seconds computing steps since it started (not waiting on another stage)."""
        assert not self._in_flight
        self._broadcast(READ_CLOCK)
        clocks = self._replies()
        return [clock.busy_s for clock in clocks if isinstance(clock, StageClock)]

    def close(self) -> None:
        self._finalizer()

    def _broadcast(self, message: object) -> None:
        if self._dead is not None:  # the others' replies are out of step now: nothing runs again
            raise WorkerDiedError(self._dead)
        for rank, link in enumerate(self._workers):
            try:
                link.send(message)
            except WorkerGoneError as error:
                raise self._died(rank, error) from error

    def _replies(self) -> list[object]:
        """Every worker's reply, in rank order; the first failure raised once all have answered."""
        replies = []
        for rank, link in enumerate(self._workers):
            try:
                replies.append(link.recv())
            except WorkerGoneError as error:
                raise self._died(rank, error) from error
        for reply in replies:
            if isinstance(reply, WorkerFailed):
                raise reply.error
        return replies

    def _died(self, rank: int, error: WorkerGoneError) -> WorkerDiedError:
        self._dead = f"parallel worker {rank} {error}"
        return WorkerDiedError(self._dead)


def _stop(workers: list[WorkerLink], release: Callable[[], None] | None) -> None:
    stop_all(workers)
    if release is not None:
        release()


def _for_workers(batch: ScheduledBatch) -> ScheduledBatch:
    """The rows as a worker needs them: which rows sample stays, the matchers and generators go."""

    def strip(row: ScheduledRow) -> ScheduledRow:
        if row.sampling is None:
            return row
        return dataclasses.replace(
            row, sampling=dataclasses.replace(row.sampling, generator=None, grammar=None)
        )

    return dataclasses.replace(batch, rows=tuple(strip(row) for row in batch.rows))
