"""The engine core's busy loop, wherever it runs (a thread of the replica's process, or a process of
its own): apply the frontend's messages, step, and send back one EngineOutputs per step.

Messages in are AddRequest, AbortRequest, SetPaused and SHUTDOWN; out, per step, every request's new tokens
(and the finals of aborted ones), the published stats and, where the core's metrics cannot reach
the exporter itself (another process), the metric updates it buffered."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from common.kv_transfer import KvBlocks
from common.metrics_sinks import MetricOp
from replica_engine.engine_core import EngineCore
from replica_engine.errors import StepFailedError
from replica_engine.outputs import CoreOutput, EngineStats
from replica_engine.request import Request

logger = logging.getLogger(__name__)
# The prefix cache's keys (a tuple as long as the pool) are taken and sent at most this often while
# requests run; routers read them every ~0.5 s. Copied every step, they were among a served
# core's largest host costs in a profile (not kept). An idle core takes and sends them at once.
HASHES_EVERY_S = 0.2
# The gauges (queue depth, running, KV usage) are recorded at most this often while requests run:
# Prometheus scrapes every few seconds, and each record through Ray cost ~0.1 ms of the core's step.
GAUGES_EVERY_S = 0.1
# An idle core republishes its gauges this often: Ray's metrics agent drops a gauge series that
# is not refreshed.
GAUGE_REFRESH_S = 0.5
# A failing request is finished with reason error and the rest go on (EngineCore.step); this
# many steps in a row where every request failed mean the engine itself is broken (a lost
# device, a corrupted cache), so it stops and reports unhealthy.
MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass(frozen=True)
class AddRequest:
    request: Request  # its id is unique per add (the frontend's key), never reused
    kv: KvBlocks | None = None  # its prompt's leading blocks, computed by a prefill replica


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    reason: FinishReason


@dataclass(frozen=True)
class SetPaused:
    """Paused, the core takes no step: its requests keep their KV blocks and state, new ones
    wait, aborts still end them. Messages keep their order, so whatever the frontend sent after a
    pause waits for the resume (vLLM's pause_generation, in its mode that keeps requests)."""

    paused: bool


SHUTDOWN = "shutdown"
CoreMessage = AddRequest | AbortRequest | SetPaused | str


@dataclass(frozen=True)
class EngineOutputs:
    """What the core sends after each step (or message, or idle wait): the outputs, the stats
    after it, and the prefix-cache keys if they changed since the last they sent (else None)."""

    outputs: list[CoreOutput]
    stats: EngineStats | None  # its cached_block_hashes left empty (see below); None: unknown
    cached_block_hashes: tuple[bytes, ...] | None = None
    metric_ops: list[MetricOp] = field(default_factory=list)
    dead: str | None = None  # the core stopped: why (this is its last message)


class CoreLoop:
    def __init__(
        self,
        core: EngineCore,
        receive: Callable[[float | None], CoreMessage | None],
        emit: Callable[[EngineOutputs], None],
        drain_metrics: Callable[[], list[MetricOp]] = list,
    ) -> None:
        """`receive(timeout)`: the next message, waiting up to `timeout` (None: none waiting);
        `emit`: send an EngineOutputs to the frontend; `drain_metrics`: metric updates to carry."""
        self.core = core
        core.cached_hashes_every_s = HASHES_EVERY_S
        core.gauges_every_s = GAUGES_EVERY_S
        self.receive = receive
        self.emit = emit
        self.drain_metrics = drain_metrics
        self._hashes_sent: tuple[bytes, ...] | None = None
        self._num_applied = 0  # messages the latest drain applied
        self._paused = False

    def run(self) -> None:
        """Until SHUTDOWN; an error outside any one request's work ends the loop after one last
        EngineOutputs that fails every request and says why (`dead`)."""
        try:
            self._send([])  # the stats at start
            self._run()
        except BaseException as error:  # the loop cannot go on
            self._die(error, [])

    def _run(self) -> None:
        consecutive_failures = 0
        while True:
            finals = self._apply_messages(wait=not self._has_work())
            if finals is None:
                return
            busy = self._has_work()
            if self._num_applied or not busy:
                # What the messages changed (queue depth, aborts' finals) is visible at once, not
                # only after the next step: routers and autoscaling read these stats.
                self._send(finals)
                finals = []
            if not busy:
                continue
            try:
                outputs = self.core.step()
            except StepFailedError as failure:  # its requests are finished (reason error)
                consecutive_failures += 1
                if consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                    # Dead in the same message that fails these requests: a caller who retries
                    # at once is refused (503), not queued on an engine about to stop.
                    self._die(failure, finals + failure.outputs)
                    return
                outputs = failure.outputs
            else:
                consecutive_failures = 0
            self._send(finals + outputs)

    def _apply_messages(self, wait: bool) -> list[CoreOutput] | None:
        """Apply every queued message (when `wait`, first wait for one up to GAUGE_REFRESH_S); the
        final outputs of what they aborted, or None once asked to shut down."""
        finals: list[CoreOutput] = []
        self._num_applied = 0
        message = self.receive(GAUGE_REFRESH_S if wait else None)
        while message is not None:
            self._num_applied += 1
            if message == SHUTDOWN:
                return None
            if isinstance(message, AddRequest):
                self.core.add_request(message.request, message.kv)
            elif isinstance(message, AbortRequest):
                final = self.core.abort_request(message.request_id, message.reason)
                if final is not None:
                    finals.append(final)
            elif isinstance(message, SetPaused):
                self._paused = message.paused
            message = self.receive(None)
        self.core.publish_stats()
        return finals

    def _has_work(self) -> bool:
        """A step to take: requests, and not paused."""
        return not self._paused and self.core.has_unfinished_requests()

    def _send(self, outputs: list[CoreOutput]) -> None:
        stats = self.core.stats
        hashes = stats.cached_block_hashes  # a new snapshot at most every HASHES_EVERY_S
        fresh = hashes is not self._hashes_sent
        if fresh:
            self._hashes_sent = hashes
        self.emit(
            EngineOutputs(
                outputs,
                _without_hashes(stats),
                hashes if fresh else None,
                self.drain_metrics(),
            )
        )

    def _die(self, error: BaseException, outputs: list[CoreOutput]) -> None:
        """Fail every request, loudly; the frontend refuses new ones and health checks fail."""
        logger.error("the engine core stopped", exc_info=error)
        try:
            outputs = outputs + self.core.fail_all_requests()
            self.core.publish_stats()
        except Exception:
            logger.exception("could not finish the requests of a stopped engine")
        stats = _without_hashes(self.core.stats)
        self.emit(EngineOutputs(outputs, stats, None, self.drain_metrics(), f"engine stopped: {error!r}"))


def _without_hashes(stats: EngineStats) -> EngineStats:
    return dataclasses.replace(stats, cached_block_hashes=())
