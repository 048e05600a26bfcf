"""The engine for an asyncio server (the Serve replica): the model steps on a background thread,
so the event loop never blocks on it; each request is an async stream of RequestOutputs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from replica_engine.config import EngineConfig
from replica_engine.engine import EngineStats, LLMEngine, Prompt
from replica_engine.metrics import EngineMetrics
from replica_engine.outputs import RequestOutput
from replica_engine.sampling_params import SamplingParams

GAUGE_REFRESH_S = 0.5


class EngineDeadError(RuntimeError):
    """The step loop died; no request can be served by this engine any more."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, metrics: EngineMetrics | None = None) -> None:
        self.engine = LLMEngine(config, metrics)
        self.error: BaseException | None = None
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run_steps, name="stallfree-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Validate and queue a request (raising InvalidRequestError at once if it is bad); return
        its stream. Closing the stream early (or cancelling the task reading it) aborts it."""
        if not self.is_healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        request_id = self.engine.add_request(prompt, params, request_id)
        self._streams[request_id] = stream
        self._wakeup.set()
        return self._read(request_id, stream)

    async def _read(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.engine.abort_request(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request now (its blocks are free on return); its stream ends with finish_reason abort."""
        output = self.engine.abort_request(request_id)
        if output is not None:
            self._deliver(request_id, output)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _run_steps(self) -> None:
        while not self._stopping:
            if not self.engine.has_unfinished_requests():
                # Idle: still republish the gauges now and then, as Ray's metrics agent drops a
                # gauge series that is not refreshed within two report intervals.
                self._wakeup.wait(timeout=GAUGE_REFRESH_S)
                self._wakeup.clear()
                self.engine.record_stats()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as error:  # the loop cannot go on: fail every stream, loudly
                self.error = error
                for request_id in list(self._streams):
                    self._deliver(request_id, EngineDeadError(f"engine step failed: {error!r}"))
                self.engine.fail_all_requests()
                raise
            for output in outputs:
                self._deliver(output.request_id, output)
