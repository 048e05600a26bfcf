"""Where the engine core runs, behind one interface: `ThreadCore` (a thread of this process) or
`ProcessCore` (core_process.py: a process of its own, vLLM v1's EngineCore process, so the
frontend's event loop, detokenizing and Ray never hold the core's interpreter). Both run CoreLoop,
take CoreMessages from any thread with `send`, and hand every EngineOutputs to `on_outputs` on a
thread of their own (the step thread; the reader of the core process's socket)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

from replica_engine.config import EngineConfig
from replica_engine.core_loop import SHUTDOWN, CoreLoop, CoreMessage, EngineOutputs
from replica_engine.engine import build_engine
from replica_engine.input_processor import InputProcessor
from replica_engine.metrics import EngineMetrics

logger = logging.getLogger(__name__)
OnOutputs = Callable[[EngineOutputs], None]


class CoreClient(Protocol):
    inputs: InputProcessor

    def send(self, message: CoreMessage) -> None: ...

    def is_alive(self) -> bool: ...

    def shutdown(self) -> None: ...


class ThreadCore:
    def __init__(self, config: EngineConfig, metrics: EngineMetrics | None, on_outputs: OnOutputs) -> None:
        self._inbox: queue.SimpleQueue[CoreMessage] = queue.SimpleQueue()
        self._error: BaseException | None = None
        built = threading.Event()
        self._thread = threading.Thread(
            target=self._build_and_run,
            args=(config, metrics, on_outputs, built),
            name="stallfree-engine",
            daemon=True,
        )
        self._thread.start()
        built.wait()
        if self._error is not None:  # a bad setting, a model that would not load: the caller's error
            raise self._error

    def _build_and_run(
        self,
        config: EngineConfig,
        metrics: EngineMetrics | None,
        on_outputs: OnOutputs,
        built: threading.Event,
    ) -> None:
        """The engine is built on the thread that steps it, so that one thread only ever runs torch's
        OpenMP regions: a second thread's OpenMP team (loading the model elsewhere is enough) makes
        libgomp throttle its spin-waits, as there are then more OpenMP threads than cores: on 2 cores
        that cost a bf16 decode step ~30% (29 vs 22 ms at batch 1)."""
        try:
            self.core, self.inputs = build_engine(config, metrics)
        except BaseException as error:
            self._error = error
            return
        finally:
            built.set()
        CoreLoop(self.core, self._receive, on_outputs).run()

    def _receive(self, timeout: float | None) -> CoreMessage | None:
        try:
            return self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def send(self, message: CoreMessage) -> None:
        self._inbox.put(message)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._inbox.put(SHUTDOWN)
        self._thread.join(timeout=10)
