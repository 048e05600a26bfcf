"""The engine's state and its step: scheduler, KV cache, model runner, metrics.

One owner: only the thread that steps it calls its methods (the caller of LLMEngine, or the
core loop behind AsyncEngine, in a process of its own or on a thread, which applies the
frontend's adds and aborts between steps). Other threads read `stats`, a snapshot the owner
publishes, and nothing else. "The step thread" elsewhere means that owner."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from common.finish_reason import FinishReason
from common.kv_transfer import KvBlocks
from common.logprobs import TokenLogprob
from replica_engine.errors import StepFailedError
from replica_engine.executor import Executor, PipelinedExecutor, RunnerOutput, SampledTokens
from replica_engine.kv_cache_manager import KVCacheManager
from replica_engine.outputs import CoreOutput
from replica_engine.request import Request
from replica_engine.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from replica_engine.scheduler.plan import ScheduledBatch, StepSummary
from replica_engine.scheduler.step_time_model import ExpertRouting, StepTime, StepTimeModel
from replica_engine.scheduler.token_budget import SLOTokenBudget
from replica_engine.step_listeners import StepListener, StepLoad, StepTimeLearner

if TYPE_CHECKING:
    import torch  # an embedding's parts; the core itself needs no torch

    from replica_engine.metrics import EngineMetrics
    from replica_engine.spec_decode.config import SpeculativeConfig
    from replica_engine.spec_decode.proposers import Proposer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecutedBatch:
    """What running a step's batch gave: the requests that ran (all, unless the batch raised and
    its rows were rerun one by one), what they computed, and the requests that failed."""

    ran: ScheduledBatch
    output: RunnerOutput
    failed_request_ids: list[str]

    def summary(self, duration_s: float) -> StepSummary:
        return self.ran.summary(duration_s, len(self.failed_request_ids), self.output.model_s)


class CoreSettings(Protocol):
    """What the core reads of its settings: a resolved EngineConfig's, or the simulator's
    ReplicaConfig's."""

    model: str  # part of every block's hash
    block_size: int
    enable_prefix_caching: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    scheduling_policy: str
    tbt_slo_s: float | None
    max_loras: int
    max_cpu_loras: int | None  # None: max_loras
    speculative: SpeculativeConfig | None  # parsed speculative_config


class EngineCore:
    def __init__(
        self,
        config: CoreSettings,
        runner: Executor,
        num_kv_blocks: int,
        metrics: EngineMetrics | None,
        step_time: StepTime | None = None,
        clock: Callable[[], float] = time.perf_counter,
        proposer: Proposer | None = None,
        experts: ExpertRouting | None = None,
    ) -> None:
        """`step_time`: a fixed step-time model for a TBT target (the simulator's); without it, one
        is fitted on a startup profile of `runner` and keeps learning from every step. `clock`
        times the steps (the simulator's is virtual). `proposer`: a draft model's, loaded with the
        engine (other speculative methods build their own). `experts`: a mixture of experts'
        routing, which the fitted step-time model takes as a feature of its own."""
        self.config = config
        self.experts = experts
        self.runner = runner
        self.clock = clock
        runner.allocate_kv_cache(num_kv_blocks + 1)  # + the null block
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching, model=config.model
        )
        scheduler_config = SchedulerConfig(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.max_loras,
            config.max_cpu_loras or config.max_loras,
            config.speculative,
        )
        profiled = None if step_time is not None else self._profiled_step_time(num_kv_blocks)
        step_time = step_time or profiled
        self.slo_budget = (
            SLOTokenBudget(step_time, config.tbt_slo_s) if step_time and config.tbt_slo_s else None
        )
        self.scheduler = SCHEDULING_POLICIES[config.scheduling_policy](
            scheduler_config, self.kv_cache_manager, self.slo_budget, step_time, proposer
        )
        self.metrics = metrics
        self.step_load = StepLoad()
        self.step_listeners: list[StepListener] = [self.step_load]
        if metrics is not None:
            self.step_listeners.append(metrics.record_step)
        if profiled is not None:  # fitted here: it keeps learning (a given model stays as it is)
            self.step_listeners.append(StepTimeLearner(profiled, self.slo_budget, metrics))
        # Under pipeline parallelism or async scheduling: the batches in flight, oldest first,
        # with when each was scheduled.
        self._pipeline = cast(PipelinedExecutor, runner) if runner.pipeline_depth > 1 else None
        self._in_pipeline: deque[tuple[ScheduledBatch, float]] = deque()
        self._ahead = runner.schedules_ahead  # async scheduling: a batch in flight holds none back
        self._last_collected_at = 0.0
        # While requests run, publish_stats takes the prefix cache's keys (a tuple as long as the
        # pool) at most this often (0: every time; the core loop behind a served engine sets it).
        self.cached_hashes_every_s = 0.0
        self._hashes_taken_at = -math.inf
        # And records the gauges at most this often while requests run (0: every step; the core
        # loop sets it): Ray's Gauge.set cost a served core about 0.1 ms each, 5 of them a step.
        self.gauges_every_s = 0.0
        self._gauges_recorded_at = -math.inf
        self.stats = self.scheduler.stats()
        self.publish_stats()

    def _profiled_step_time(self, num_kv_blocks: int) -> StepTimeModel | None:
        """For a TBT target or speculative decoding (which price a step's tokens): a step-time
        model fitted on a startup profile; None without either."""
        if self.config.tbt_slo_s is None and self.config.speculative is None:
            return None
        from replica_engine.step_profile import PROFILE_REACH, profile_step_times  # runs the model: torch

        started = time.perf_counter()
        model = StepTimeModel(experts=self.experts)
        slo = self.config.tbt_slo_s
        prompts = slo is not None  # drafts are priced by decodes alone
        reach = PROFILE_REACH * slo if slo is not None else None
        samples = profile_step_times(self.runner, self.config, num_kv_blocks, prompts, reach)  # type: ignore[arg-type]
        model.fit_profile(samples)
        logger.info(
            "step-time model fitted in %.1f s: coefficients %s, calibration %.2f",
            time.perf_counter() - started,
            model.coefficients,
            model.calibration,
        )
        return model

    def add_request(self, request: Request, kv: KvBlocks | None = None) -> None:
        """Queue the request; with `kv` (its prompt's leading blocks, from a prefill replica),
        adopt them first: its admission then finds them in the prefix cache."""
        if kv is not None and request.request_id not in self.scheduler.requests:  # else add refuses it
            self._adopt(request, kv)
        self.scheduler.add_request(request)

    def _adopt(self, request: Request, kv: KvBlocks) -> None:
        """Hold pool blocks for `kv`'s blocks and write their K/V; what does not fit, or blocks
        of another layout or prompt (the last one's hash differs), the request computes itself."""
        manager = self.kv_cache_manager
        too_many = kv.num_blocks > (request.num_prompt_tokens - 1) // manager.block_size
        sized = kv.data is None or kv.data.nbytes == kv.nbytes
        if kv.layout != self.runner.kv_layout or too_many or not sized:
            logger.warning("request %s: the K/V it brought does not fit this engine", request.request_id)
            return
        hashes = manager.block_hashes(request, kv.num_blocks)
        if not hashes or hashes[-1] != kv.last_hash:
            logger.warning("request %s: the K/V it brought is another prompt's", request.request_id)
            return
        to_write = manager.hold_prefix(request, kv.num_blocks)
        if to_write and kv.data is not None:
            indices, block_ids = zip(*to_write, strict=True)
            self.runner.write_kv_blocks(list(block_ids), kv.data, list(indices))

    def _export(self, request: Request) -> KvBlocks | None:
        """A finished request's prompt: the leading full blocks the prefix cache still holds (all
        of them, as it has just finished), read for a decode replica. None if there are none."""
        manager, layout = self.kv_cache_manager, self.runner.kv_layout
        if layout is None:
            return None
        hashes = manager.block_hashes(request, (request.num_prompt_tokens - 1) // manager.block_size)
        block_ids = manager.cached_run(hashes)
        if not block_ids:
            return None
        data = self.runner.read_kv_blocks(block_ids)
        return KvBlocks(layout, len(block_ids), hashes[len(block_ids) - 1], data)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> CoreOutput | None:
        """Finish a request now, freeing its blocks; None if it is not in flight."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish_request(request, reason)
        if self.metrics is not None:
            self.metrics.record_finished(request, time.monotonic())
        return CoreOutput(request_id, [], request.num_prompt_tokens, reason, request.num_cached_tokens)

    def fail_all_requests(self) -> list[CoreOutput]:
        """The engine cannot go on: finish every request with reason error."""
        return [
            self.abort_request(request_id, FinishReason.ERROR) for request_id in list(self.scheduler.requests)
        ]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_pipeline)

    def publish_stats(self) -> None:
        """Snapshot the gauges (queue depth, running, KV usage) for readers on any thread; while
        requests run, the prefix cache's keys at most every `cached_hashes_every_s` (in between,
        the snapshot keeps the keys it had) and the metrics' gauges at most every
        `gauges_every_s`. An idle core takes and records both at once."""
        now, idle = self.clock(), not self.has_unfinished_requests()
        take = idle or now - self._hashes_taken_at >= self.cached_hashes_every_s
        hashes = None if take else self.stats.cached_block_hashes
        self.stats = self.scheduler.stats(step_work_s=self.step_load.work_s, cached_block_hashes=hashes)
        if take:
            self._hashes_taken_at = now
        if self.metrics is not None and (idle or now - self._gauges_recorded_at >= self.gauges_every_s):
            self.metrics.record_stats(self.stats)
            self._gauges_recorded_at = now

    def step(self) -> list[CoreOutput]:
        """Schedule, execute, update: an output for every request that got a token or finished.
        A request whose computation fails is finished with reason `error`; the others go on.
        Raises StepFailedError (after finishing them) if every request of the step failed."""
        if self._pipeline is not None:
            return self._step_pipelined(self._pipeline)
        started = self.clock()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        return self._finish_step(self._execute(batch), started)

    def _step_pipelined(self, pipeline: PipelinedExecutor) -> list[CoreOutput]:
        """vLLM v1's batch queue: while the pipeline has room, schedule and submit, returning at
        once; wait for the oldest batch when the pipeline is full or nothing more could be
        scheduled. Pipeline stages: requests in flight sit out. Async scheduling (two batches):
        step N+1 is scheduled and submitted while step N runs, its requests' tokens from N as
        placeholders, and N's tokens reach the host after. A batch that fails in the pipeline
        finishes its requests, reason error (its rows are not rerun alone: the batches behind it
        are already in the pipeline); one that fails on submit (async) is rerun row by row."""
        if len(self._in_pipeline) < pipeline.pipeline_depth:
            scheduled_at = self.clock()
            batch = self.scheduler.schedule(ahead=self._ahead and bool(self._in_pipeline))
            if not batch.is_empty:
                try:
                    pipeline.submit(batch)
                except Exception:
                    if not self._ahead:
                        raise
                    logger.exception("a step of %d requests failed", len(batch.rows))
                    return self._rerun_after_flight(batch, scheduled_at)
                self._in_pipeline.append((batch, scheduled_at))
                if len(self._in_pipeline) < pipeline.pipeline_depth:
                    return []
        if not self._in_pipeline:
            return []
        return self._collect_oldest(pipeline)

    def _collect_oldest(self, pipeline: PipelinedExecutor) -> list[CoreOutput]:
        batch, scheduled_at = self._in_pipeline.popleft()
        # Async: the batch ran once the one before it was back; its time is from then on (what
        # its requests wait between tokens). Stages: from its scheduling on (it sat out the rest).
        started = max(scheduled_at, self._last_collected_at) if self._ahead else scheduled_at
        try:
            executed = ExecutedBatch(batch, pipeline.collect(), [])
        except Exception:
            logger.exception("a step of %d requests failed", len(batch.rows))
            executed = ExecutedBatch(batch.only([]), RunnerOutput(), [row.request_id for row in batch.rows])
        self._last_collected_at = self.clock()
        return self._finish_step(executed, started)

    def _rerun_after_flight(self, batch: ScheduledBatch, scheduled_at: float) -> list[CoreOutput]:
        """A batch scheduled ahead failed on submit: the batches in flight come back first (its
        placeholders' tokens), then its rows run as a synchronous step's would, alone where the
        whole fails. Each is finished whatever the others did; if every request of one of them
        failed, StepFailedError carries every output."""
        pipeline = cast(PipelinedExecutor, self.runner)
        results = [
            self._outputs_of(lambda: self._collect_oldest(pipeline)) for _ in range(len(self._in_pipeline))
        ]
        requests = self.scheduler.requests
        rerun = batch.only(row.request_id for row in batch.rows if row.request_id in requests)
        if not rerun.is_empty:  # else every request of it ended with the batches before
            results.append(self._outputs_of(lambda: self._finish_step(self._execute(rerun), scheduled_at)))
        outputs = [output for step_outputs, _ in results for output in step_outputs]
        if any(failed for _, failed in results):
            raise StepFailedError(outputs)
        return outputs

    @staticmethod
    def _outputs_of(step: Callable[[], list[CoreOutput]]) -> tuple[list[CoreOutput], bool]:
        """A step's outputs, and whether every request of it failed (StepFailedError's outputs)."""
        try:
            return step(), False
        except StepFailedError as failure:
            return failure.outputs, True

    def _finish_step(self, executed: ExecutedBatch, started: float) -> list[CoreOutput]:
        outputs = self._update(executed)
        self.publish_stats()
        if executed.ran.is_empty:  # every request failed
            raise StepFailedError(outputs)
        summary = executed.summary(duration_s=self.clock() - started)
        for listener in self.step_listeners:
            listener(summary)
        return outputs

    def _execute(self, batch: ScheduledBatch) -> ExecutedBatch:
        """Run the batch. If it raises, run each request's rows alone to find the ones that fail
        (the rest of the work is redone: K/V slots are simply written again)."""
        try:
            return ExecutedBatch(batch, self.runner.execute(batch), [])
        except Exception:
            logger.exception("a step of %d requests failed", len(batch.rows))
        if len(batch.rows) == 1:
            return ExecutedBatch(batch.only([]), RunnerOutput(), [batch.rows[0].request_id])
        alone: dict[str, RunnerOutput] = {}
        failed: list[str] = []
        for row in batch.rows:
            try:
                alone[row.request_id] = self.runner.execute(batch.only([row.request_id]))
            except Exception:
                logger.exception("request %s fails on its own", row.request_id)
                failed.append(row.request_id)
        survivors = batch.only(alone)
        sampled = [alone[row.request_id].sampled for row in survivors.sampling_rows]
        output = RunnerOutput(
            SampledTokens(
                [s.token_ids[0] for s in sampled],
                [s.logprobs[0] for s in sampled],
                tuple(s.num_accepted[0] if s.num_accepted else 0 for s in sampled),
            ),
            {rid: logprobs for out in alone.values() for rid, logprobs in out.prompt_logprobs.items()},
            sum(out.model_s for out in alone.values()),
            {rid: part for out in alone.values() for rid, part in out.pooled.items()},
        )
        return ExecutedBatch(survivors, output, failed)

    def _update(self, executed: ExecutedBatch) -> list[CoreOutput]:
        """Advance the requests that ran (an output each); finish the failed ones, reason error."""
        ran, sampled = self._still_awaited(executed.ran, executed.output.sampled)
        for request_id, logprobs in executed.output.prompt_logprobs.items():
            if request_id in self.scheduler.requests:
                self.scheduler.requests[request_id].prompt_logprobs += logprobs
        advanced = self.scheduler.update(ran, sampled.token_ids, sampled.num_accepted)
        if self.metrics is not None and sampled.num_accepted:
            for row, accepted in zip(ran.sampling_rows, sampled.num_accepted, strict=True):
                if row.draft_token_ids:
                    self.metrics.record_drafts(len(row.draft_token_ids), accepted)
        now = time.monotonic()
        outputs = [
            self._token_output(request, num_new, logprob, now)
            for (request, num_new), logprob in zip(advanced, sampled.logprobs, strict=True)
        ]
        if self.metrics is not None:
            self.metrics.record_generated(sum(num_new for _, num_new in advanced))
        outputs += self._pool(ran, executed.output.pooled, now)
        failed = [
            self.abort_request(request_id, FinishReason.ERROR) for request_id in executed.failed_request_ids
        ]
        return outputs + [output for output in failed if output is not None]

    def _pool(self, ran: ScheduledBatch, parts: dict[str, torch.Tensor], now: float) -> list[CoreOutput]:
        """Add each embedding row's part to its request's; a request whose whole prompt has now
        run is finished (stop) with its embedding, freeing its blocks."""
        outputs = []
        for row in ran.rows:
            if row.pooling is None:
                continue
            request = self.scheduler.requests[row.request_id]
            request.pooled = row.pooling.add(request.pooled, parts[row.request_id], row.start_position)
            if request.num_computed_tokens < request.num_prompt_tokens:
                continue
            embedding = row.pooling.finish(request.pooled, request.num_prompt_tokens)
            self.scheduler.finish_request(request, FinishReason.STOP)
            if self.metrics is not None:
                self.metrics.record_finished(request, now)
            outputs.append(
                CoreOutput(
                    request.request_id,
                    [],
                    request.num_prompt_tokens,
                    FinishReason.STOP,
                    request.num_cached_tokens,
                    embedding=embedding,
                )
            )
        return outputs

    def _still_awaited(
        self, batch: ScheduledBatch, sampled: SampledTokens
    ) -> tuple[ScheduledBatch, SampledTokens]:
        """The batch without the rows of requests that finished while it ran (aborted while in a
        pipeline, or stopped by the batch before it): what they computed is dropped."""
        requests = self.scheduler.requests
        awaited = [row.request_id for row in batch.rows if row.request_id in requests]
        if len(awaited) == len(batch.rows):
            return batch, sampled
        kept = [index for index, row in enumerate(batch.sampling_rows) if row.request_id in requests]
        return batch.only(awaited), sampled.only(kept)

    def _token_output(
        self, request: Request, num_new: int, logprob: TokenLogprob | None, now: float
    ) -> CoreOutput:
        if self.metrics is not None:
            self.metrics.record_token(request, now, request.last_token_time, num_new)
            if request.is_finished:
                self.metrics.record_finished(request, now)
        request.last_token_time = now
        first = len(request.output_token_ids) == num_new
        wants_prompt_logprobs = first and request.sampling_params.prompt_logprobs is not None
        kv = self._export(request) if request.kv_export and request.is_finished else None
        return CoreOutput(
            request.request_id,
            request.output_token_ids[-num_new:],
            request.num_prompt_tokens,
            request.finish_reason,
            request.num_cached_tokens,
            new_logprobs=[] if logprob is None else [logprob],
            prompt_logprobs=request.prompt_logprobs if wants_prompt_logprobs else None,
            kv=kv,
        )
