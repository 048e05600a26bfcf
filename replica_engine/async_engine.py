"""The engine for an asyncio server (the Serve replica). One step thread owns the EngineCore:
it alone schedules, runs the model and changes request and KV state. Other threads send it
messages (add, abort) on a queue it drains between steps, and read the stats it publishes.
Each request is an async stream of RequestOutputs, detokenized on the event loop that reads it,
so the step thread does schedule -> execute -> update only.

Abort timing: `abort` (or closing a stream) ends the stream at once, with finish_reason abort;
the request's KV blocks are free by the end of the step running when it was called."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from common.errors import InvalidRequestError
from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams
from replica_engine.config import EngineConfig
from replica_engine.engine import build_engine
from replica_engine.errors import EngineDeadError, StepFailedError
from replica_engine.input_processor import Prompt
from replica_engine.metrics import EngineMetrics
from replica_engine.output_processor import RequestState
from replica_engine.outputs import CoreOutput, EngineStats, RequestOutput
from replica_engine.request import Request

logger = logging.getLogger(__name__)
GAUGE_REFRESH_S = 0.5
# A failing request is finished with reason error and the rest go on (EngineCore.step); this
# many steps in a row where every request failed mean the engine itself is broken (a lost
# device, a corrupted cache), so it stops and reports unhealthy.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class _OutputQueue:
    """One request's outputs, queued for the caller's stream (`_read`) on `loop`, the event loop
    reading it; its methods run on that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, state: RequestState) -> None:
        self.loop = loop
        self.state = state  # detokenizing and stop strings, on this loop
        self.ready: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def end(self, reason: FinishReason) -> None:
        output = self.state.finish(reason)
        if output is not None:
            self.ready.put_nowait(output)

    def fail(self, error: BaseException) -> None:
        if not self.state.finished:
            self.state.finish_reason = FinishReason.ERROR
            self.ready.put_nowait(error)


@dataclass(frozen=True)
class _Add:
    request: Request
    output_queue: _OutputQueue


@dataclass(frozen=True)
class _Abort:
    request_id: str
    reason: FinishReason


_SHUTDOWN = object()


def _post(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> bool:
    """Run `callback(*args)` on `loop`; False if that loop has closed (its reader is gone)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, metrics: EngineMetrics | None = None) -> None:
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue[_Add | _Abort | object] = queue.SimpleQueue()
        self._open_queues: dict[str, _OutputQueue] = {}  # event-loop side: queues whose stream is open
        self._sinks: dict[str, _OutputQueue] = {}  # step-thread side: where each request's outputs go
        built = threading.Event()
        self._thread = threading.Thread(
            target=self._build_and_run,
            args=(config or EngineConfig(), metrics, built),
            name="stallfree-engine",
            daemon=True,
        )
        self._thread.start()
        built.wait()
        if self.error is not None:  # a bad setting, a model that would not load: the caller's error
            raise self.error

    def _build_and_run(
        self, config: EngineConfig, metrics: EngineMetrics | None, built: threading.Event
    ) -> None:
        """The engine is built on the thread that steps it, so that one thread only ever runs torch's
        OpenMP regions: a second thread's OpenMP team (loading the model elsewhere is enough) makes
        libgomp throttle its spin-waits, as there are then more OpenMP threads than cores: on 2 cores
        that cost a bf16 decode step ~30% (29 vs 22 ms at batch 1)."""
        try:
            self.core, self.inputs = build_engine(config, metrics)
        except BaseException as error:
            self.error = error
            return
        finally:
            built.set()
        self._run_steps()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Validate and queue a request (raising InvalidRequestError at once if it is bad); return
        its stream. Closing the stream early (or cancelling the task reading it) aborts it."""
        self._check_alive()
        # Compiled on a worker thread, before the request is queued: a step never waits for it.
        grammar = None
        if params is not None and params.structured_outputs is not None:
            grammar = await asyncio.to_thread(self.inputs.compile_grammar, params)
        request = self.inputs.make_request(prompt, params, request_id, self._open_queues, grammar)
        request_id = request.request_id
        state = RequestState(request, self.inputs.tokenizer, self._end_by_stop_string)
        output_queue = _OutputQueue(asyncio.get_running_loop(), state)
        self._open_queues[request_id] = output_queue
        self._inbox.put(_Add(request, output_queue))
        # The step thread sets `error` before its last drain of the queue: if it is still unset
        # here, this message will be taken (and answered) either way.
        if self.error is not None:
            self._open_queues.pop(request_id, None)
            self._check_alive()
        return self._read(request_id, output_queue)

    def _check_alive(self) -> None:
        if not self.is_healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")

    async def _read(self, request_id: str, output_queue: _OutputQueue) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await output_queue.ready.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._open_queues.pop(request_id, None)
            if not output_queue.state.finished:  # the reader left early
                output_queue.state.finish(FinishReason.ABORT)
                self._inbox.put(_Abort(request_id, FinishReason.ABORT))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Stop a request from any thread: its stream ends at once with this finish_reason; its KV
        blocks are free by the end of the step running now."""
        self._inbox.put(_Abort(request_id, reason))
        output_queue = self._open_queues.get(request_id)
        if output_queue is None:
            return
        try:
            on_its_loop = asyncio.get_running_loop() is output_queue.loop
        except RuntimeError:
            on_its_loop = False
        if on_its_loop:
            output_queue.end(reason)
        else:
            _post(output_queue.loop, output_queue.end, reason)

    def stats(self) -> EngineStats:
        """The snapshot the step thread published after its latest step (or message)."""
        return self.core.stats

    def shutdown(self) -> None:
        self._inbox.put(_SHUTDOWN)
        self._thread.join(timeout=10)

    # -- the event loop's side of outputs -------------------------------------------------
    def _receive(self, items: list[tuple[_OutputQueue, CoreOutput]]) -> None:
        for output_queue, core_output in items:
            output = output_queue.state.process(core_output)
            if output is not None:
                output_queue.ready.put_nowait(output)

    def _end_by_stop_string(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id, FinishReason.STOP))

    # -- the step thread ------------------------------------------------------------------
    def _run_steps(self) -> None:
        consecutive_failures = 0
        try:
            while self._apply_messages(wait=not self.core.has_unfinished_requests()):
                if not self.core.has_unfinished_requests():
                    continue
                try:
                    outputs = self.core.step()
                except StepFailedError as failure:  # its requests are finished (reason error)
                    consecutive_failures += 1
                    if consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        # Dead before these requests hear of it: a caller who retries at once
                        # is refused (503), not queued on an engine about to stop.
                        self.error = failure
                        self._deliver(failure.outputs)
                        raise
                    self._deliver(failure.outputs)
                    continue
                consecutive_failures = 0
                self._deliver(outputs)
        except BaseException as error:  # outside any one request's work: the loop cannot go on
            self._die(error)

    def _apply_messages(self, wait: bool) -> bool:
        """Apply every queued message; when `wait`, first wait for one up to GAUGE_REFRESH_S (an
        idle engine republishes its gauges that often: Ray's metrics agent drops a gauge series
        that is not refreshed). False once asked to shut down."""
        try:
            message = self._inbox.get(timeout=GAUGE_REFRESH_S) if wait else self._inbox.get_nowait()
        except queue.Empty:
            if wait:
                self.core.publish_stats()
            return True
        while message is not _SHUTDOWN:
            self._apply(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                self.core.publish_stats()
                return True
        return False

    def _apply(self, message: _Add | _Abort | object) -> None:
        if isinstance(message, _Add):
            request_id = message.request.request_id
            if request_id in self._sinks:  # only a caller reusing an id it has not aborted yet
                error = InvalidRequestError("request_id", f"{request_id!r} is already in flight")
                _post(message.output_queue.loop, message.output_queue.fail, error)
                return
            self._sinks[request_id] = message.output_queue
            self.core.add_request(message.request)
        elif isinstance(message, _Abort):
            self._sinks.pop(message.request_id, None)  # its stream has ended already
            self.core.abort_request(message.request_id, message.reason)

    def _deliver(self, outputs: list[CoreOutput]) -> None:
        """Hand outputs to their queues' event loops, one call per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_OutputQueue, CoreOutput]]] = defaultdict(list)
        for output in outputs:
            output_queue = (
                self._sinks.pop(output.request_id) if output.finished else self._sinks.get(output.request_id)
            )
            if output_queue is not None:
                by_loop[output_queue.loop].append((output_queue, output))
        for loop, items in by_loop.items():
            if not _post(loop, self._receive, items):  # nobody reads these any more
                for _, output in items:
                    self._sinks.pop(output.request_id, None)
                    self.core.abort_request(output.request_id)

    def _die(self, error: BaseException) -> None:
        """Fail every request, loudly, and refuse new ones: health checks now fail."""
        logger.error("the engine stopped", exc_info=error)
        self.error = error  # before the last drain: add_request relies on this order
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(message, _Add):
                self._sinks[message.request.request_id] = message.output_queue
        dead = EngineDeadError(f"engine stopped: {error!r}")
        for output_queue in self._sinks.values():
            _post(output_queue.loop, output_queue.fail, dead)
        self._sinks.clear()
        try:
            self.core.fail_all_requests()
            self.core.publish_stats()
        except Exception:
            logger.exception("could not finish the requests of a stopped engine")
