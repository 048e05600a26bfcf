"""The engine for an asyncio server (the Serve replica): the model steps on a background thread,
so the event loop never blocks on it; each request is an async stream of RequestOutputs."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from replica_engine.config import EngineConfig
from replica_engine.engine import EngineStats, LLMEngine, Prompt
from replica_engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    StepFailedError,
)
from replica_engine.metrics import EngineMetrics
from replica_engine.outputs import RequestOutput
from replica_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
GAUGE_REFRESH_S = 0.5
# A failing request is finished with reason error and the rest go on (LLMEngine.step); this
# many steps in a row where every request failed mean the engine itself is broken (a lost
# device, a corrupted cache), so it stops and reports unhealthy.
MAX_CONSECUTIVE_STEP_FAILURES = 3


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
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        # The stream exists before the engine can step the request, so no output is missed.
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        try:
            self._check_alive()
            self.engine.add_request(prompt, params, request_id)
            self._check_alive()  # the loop may have died meanwhile, failing only older streams
        except BaseException:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)
            raise
        self._wakeup.set()
        return self._read(request_id, stream)

    def _check_alive(self) -> None:
        if not self.is_healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")

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
        consecutive_failures = 0
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
            except StepFailedError as failure:  # its requests are finished (reason error)
                consecutive_failures += 1
                for output in failure.outputs:
                    self._deliver(output.request_id, output)
                if consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                    self._die(failure)
                    return
                continue
            except BaseException as error:  # outside any request's work: the loop cannot go on
                self._die(error)
                return
            consecutive_failures = 0
            for output in outputs:
                self._deliver(output.request_id, output)

    def _die(self, error: BaseException) -> None:
        """Fail every request, loudly, and refuse new ones: health checks now fail."""
        logger.error("the engine stopped", exc_info=error)
        self.error = error
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError(f"engine stopped: {error!r}"))
        self.engine.fail_all_requests()
