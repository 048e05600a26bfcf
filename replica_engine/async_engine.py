"""The engine for an asyncio server (the Serve replica): the frontend of an engine core that runs
apart from it (on a thread of this process by default, or in a process of its own with
`core_process`: core_client.py, core_process.py). The core
alone schedules, runs the model and changes request and KV state; the frontend validates requests,
sends them, and turns the core's one message per step into each request's async stream of
RequestDeltas, detokenized on the event loop that reads it.

Each add is sent to the core under a key of its own (the request id and a count), so a stale
output of an aborted request can never reach a new request that reuses its id.

Abort timing: `abort` (or closing a stream) ends the stream at once, with finish_reason abort;
the request's KV blocks are free by the end of the step running when it was called."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import threading
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable

from common.finish_reason import FinishReason
from common.kv_transfer import KvBlocks
from common.sampling_params import SamplingParams
from replica_engine.config import EngineConfig
from replica_engine.core_client import CoreClient, ThreadCore
from replica_engine.core_loop import AbortRequest, AddRequest, EngineOutputs, SetPaused
from replica_engine.core_process import ProcessCore
from replica_engine.errors import EngineDeadError
from replica_engine.input_processor import Prompt
from replica_engine.metrics import EngineMetrics
from replica_engine.output_processor import RequestState
from replica_engine.outputs import CoreOutput, EngineStats, RequestDelta
from replica_engine.request import Request

logger = logging.getLogger(__name__)


class _OutputQueue:
    """One request's outputs, queued for the caller's stream (`_read`) on `loop`, the event loop
    reading it; its methods run on that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, state: RequestState, key: str) -> None:
        self.loop = loop
        self.state = state  # detokenizing and stop strings, on this loop
        self.key = key  # the core's name for the request
        self.ready: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()

    def end(self, reason: FinishReason) -> None:
        output = self.state.finish(reason)
        if output is not None:
            self.ready.put_nowait(output)

    def fail(self, error: BaseException) -> None:
        if not self.state.finished:
            self.state.finish_reason = FinishReason.ERROR
            self.ready.put_nowait(error)


def _post(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> bool:
    """Run `callback(*args)` on `loop`; False if that loop has closed (its reader is gone)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


class RequestStream:
    """One request's RequestDeltas. Closing it before its end, read or not, or cancelling the
    task reading it, aborts the request."""

    def __init__(self, outputs: AsyncGenerator[RequestDelta, None], close: Callable[[], None]) -> None:
        self._outputs = outputs
        self._close = close

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        return await anext(self._outputs)

    async def aclose(self) -> None:
        await self._outputs.aclose()
        self._close()  # a generator closed before its first item runs no `finally`


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, metrics: EngineMetrics | None = None) -> None:
        config = config or EngineConfig()
        self.metrics = metrics
        self.error: str | None = None  # why the core stopped, once it has
        self._stats: EngineStats | None = None
        self._hashes: tuple[bytes, ...] = ()
        self._started = threading.Event()  # the core's first stats have arrived
        self._open_queues: dict[str, _OutputQueue] = {}  # by request id: queues whose stream is open
        self._sinks: dict[str, _OutputQueue] = {}  # by core key: where each request's outputs go
        self._keys = itertools.count()
        # In its own process the core's metrics cannot reach Ray's exporter: they travel with its
        # outputs and are replayed here. On a thread of this process it records them itself.
        core_type = ProcessCore if config.runs_core_in_process else ThreadCore
        self.client: CoreClient = core_type(config, metrics, self._deliver)
        self.inputs = self.client.inputs
        self._started.wait()
        if self._stats is None:  # it died before its first step
            raise EngineDeadError(f"engine stopped at start: {self.error}")

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self.client.is_alive()

    async def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        kv_export: bool = False,
        kv: KvBlocks | None = None,
    ) -> RequestStream:
        """Validate and send a request (raising InvalidRequestError at once if it is bad); return
        its stream. Closing the stream early (or cancelling the task reading it) aborts it.
        Prefill/decode disaggregation: `kv_export` puts its prompt's full blocks in its final
        output (a prefill replica's request); `kv`, such blocks, are adopted before it runs."""
        self._check_alive()
        # Compiled on a worker thread, before the request is sent: a step never waits for it.
        grammar = None
        if params is not None and params.structured_outputs is not None:
            grammar = await asyncio.to_thread(self.inputs.compile_grammar, params)
        request = self.inputs.make_request(prompt, params, request_id, self._open_queues, grammar)
        request.kv_export = kv_export
        return self._submit(request, kv)

    async def add_embedding_request(self, prompt: Prompt, request_id: str | None = None) -> RequestStream:
        """As add_request, for a prompt-only request: its stream's one output carries the
        prompt's embedding (none if it failed or was aborted)."""
        self._check_alive()
        return self._submit(self.inputs.make_embedding_request(prompt, request_id, self._open_queues))

    def _submit(self, request: Request, kv: KvBlocks | None = None) -> RequestStream:
        """Send a checked request to the core; its stream, read on this event loop."""
        request_id = request.request_id
        key = f"{request_id}#{next(self._keys)}"
        state = RequestState(request, self.inputs.tokenizer, lambda: self._send_abort(key, FinishReason.STOP))
        request.request_id = key  # the core's name for it; its outputs carry the caller's id (state)
        output_queue = _OutputQueue(asyncio.get_running_loop(), state, key)
        self._open_queues[request_id] = output_queue
        self._sinks[key] = output_queue
        # `error` is set before the core's last outputs are delivered: if it is still unset here,
        # this queue will be answered either way (by an output, or by the dead core's failure).
        if self.error is not None:
            self._open_queues.pop(request_id, None)
            self._sinks.pop(key, None)
            self._check_alive()
        self.client.send(AddRequest(request, kv))
        close = functools.partial(self._close_stream, request_id, output_queue)
        return RequestStream(self._read(output_queue, close), close)

    def _check_alive(self) -> None:
        if not self.is_healthy:
            raise EngineDeadError(f"engine is not running: {self.error}")

    async def _read(
        self, output_queue: _OutputQueue, close: Callable[[], None]
    ) -> AsyncGenerator[RequestDelta, None]:
        failure: BaseException | None = None  # queued after outputs: raised once they are read
        try:
            while True:
                item = failure or await output_queue.ready.get()
                failure = None
                # Every output already queued goes out as one: a reader that fell behind a step
                # (a busy event loop) catches up in one message, not one per step.
                while isinstance(item, RequestDelta) and not item.finished and not output_queue.ready.empty():
                    later = output_queue.ready.get_nowait()
                    if isinstance(later, BaseException):
                        failure = later
                        break
                    item = item.then(later)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            close()

    def _close_stream(self, request_id: str, output_queue: _OutputQueue) -> None:
        """Its stream is done with: forget it (not a later request of the same id); abort the
        request if the reader left before its end."""
        if self._open_queues.get(request_id) is output_queue:
            del self._open_queues[request_id]
        if not output_queue.state.finished:
            output_queue.state.finish(FinishReason.ABORT)
            self._send_abort(output_queue.key, FinishReason.ABORT)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Stop a request from any thread: its stream ends at once with this finish_reason; its KV
        blocks are free by the end of the step running now."""
        output_queue = self._open_queues.get(request_id)
        if output_queue is None:
            return
        self._send_abort(output_queue.key, reason)
        try:
            on_its_loop = asyncio.get_running_loop() is output_queue.loop
        except RuntimeError:
            on_its_loop = False
        if on_its_loop:
            output_queue.end(reason)
        else:
            _post(output_queue.loop, output_queue.end, reason)

    def _send_abort(self, key: str, reason: FinishReason) -> None:
        self._sinks.pop(key, None)  # its stream has ended (or is ending): later outputs are stale
        self.client.send(AbortRequest(key, reason))

    def pause(self) -> None:
        """Stop stepping until `resume`: running requests keep their KV blocks and go on from where
        they were, requests added meanwhile wait (the scheduler orders them on resume), aborts
        and the callers' deadlines still end requests. For handing the replica's compute to other
        work for a while without failing its requests."""
        self.client.send(SetPaused(True))

    def resume(self) -> None:
        self.client.send(SetPaused(False))

    def stats(self) -> EngineStats:
        """The snapshot the core published after its latest step (or message)."""
        assert self._stats is not None  # __init__ raised otherwise
        return self._stats

    def shutdown(self) -> None:
        self.client.shutdown()

    # -- the core's outputs, on the client's thread ----------------------------------------
    def _deliver(self, engine_outputs: EngineOutputs) -> None:
        """Take one message of the core: its stats and metrics here, its outputs to their queues'
        event loops (one call per loop per step); a dead core fails every open stream. A message
        that cannot be delivered stops the engine rather than leave its streams waiting."""
        try:
            self._take(engine_outputs)
        except Exception as error:
            logger.exception("the core's outputs could not be delivered")
            self.error = f"outputs could not be delivered: {error!r}"
            self._fail_open_streams()
        finally:
            self._started.set()

    def _take(self, engine_outputs: EngineOutputs) -> None:
        if engine_outputs.dead is not None:
            self.error = engine_outputs.dead  # before any of these requests hears of it
        if engine_outputs.cached_block_hashes is not None:
            self._hashes = engine_outputs.cached_block_hashes
        if engine_outputs.stats is not None:
            self._stats = dataclasses.replace(engine_outputs.stats, cached_block_hashes=self._hashes)
        if self.metrics is not None and engine_outputs.metric_ops:
            self.metrics.replay(engine_outputs.metric_ops)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_OutputQueue, CoreOutput]]] = defaultdict(list)
        for output in engine_outputs.outputs:
            key = output.request_id
            output_queue = self._sinks.pop(key, None) if output.finished else self._sinks.get(key)
            if output_queue is not None:
                by_loop[output_queue.loop].append((output_queue, output))
        for loop, items in by_loop.items():
            if not _post(loop, _receive, items):  # nobody reads these any more
                for output_queue, _ in items:
                    self._send_abort(output_queue.key, FinishReason.ABORT)
        if engine_outputs.dead is not None:
            self._fail_open_streams()

    def _fail_open_streams(self) -> None:
        dead = EngineDeadError(f"engine stopped: {self.error}")
        while self._sinks:
            _, output_queue = self._sinks.popitem()
            _post(output_queue.loop, output_queue.fail, dead)


def _receive(items: list[tuple[_OutputQueue, CoreOutput]]) -> None:
    """On the queues' event loop: detokenize, and queue what each stream's reader gets."""
    for output_queue, core_output in items:
        output = output_queue.state.process(core_output)
        if output is not None:
            output_queue.ready.put_nowait(output)
