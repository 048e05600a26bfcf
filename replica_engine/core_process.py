"""The engine core in a process of its own (vLLM v1's EngineCore process): `ProcessCore` is the
frontend's end, `main` the core's. Started as `python -m replica_engine.core_process FD`, not with
multiprocessing's spawn: that re-imports the caller's main module, which breaks any script that
builds an engine outside an `if __name__ == "__main__":` guard. The two talk over a socket pair
(pickled dataclasses: CoreArgs, then CoreReady or CoreFailed; then CoreMessages in, one
EngineOutputs per step out)."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

import torch

from common.metrics_sinks import BufferedSink
from replica_engine.child_process import Channel, start_child
from replica_engine.config import EngineConfig
from replica_engine.core_client import OnOutputs
from replica_engine.core_loop import SHUTDOWN, CoreLoop, CoreMessage, EngineOutputs
from replica_engine.engine import build_engine, build_inputs
from replica_engine.metrics import EngineMetrics
from replica_engine.metrics.engine_metrics import MODEL_LABEL

logger = logging.getLogger(__name__)
SHUTDOWN_TIMEOUT_S = 10


@dataclass(frozen=True)
class CoreArgs:
    config: EngineConfig
    model_name: str | None  # the metrics' label; None: no metrics
    num_threads: int  # torch's, as the frontend was given


@dataclass(frozen=True)
class CoreReady:
    num_kv_blocks: int


@dataclass(frozen=True)
class CoreFailed:
    error: BaseException


class ProcessCore:
    """Messages go out through a sender thread, so the event loop never blocks on a full socket
    while a step runs; outputs come in on a reader thread."""

    def __init__(self, config: EngineConfig, metrics: EngineMetrics | None, on_outputs: OnOutputs) -> None:
        self._process, self._conn = start_child("replica_engine.core_process")
        self._closing = False
        model_name = metrics.labels[MODEL_LABEL] if metrics is not None else None
        self._conn.send(CoreArgs(config, model_name, torch.get_num_threads()))
        try:
            ready = self._conn.recv()
        except EOFError:
            code = self._process.wait(timeout=SHUTDOWN_TIMEOUT_S)
            raise RuntimeError(f"the engine core process exited at start (code {code})") from None
        if isinstance(ready, CoreFailed):
            self._process.wait(timeout=SHUTDOWN_TIMEOUT_S)
            raise ready.error
        self.inputs = build_inputs(config, ready.num_kv_blocks)
        self._outbox: queue.SimpleQueue[CoreMessage] = queue.SimpleQueue()
        threading.Thread(target=self._send_messages, name="stallfree-core-sender", daemon=True).start()
        self._reader = threading.Thread(
            target=self._read_outputs, args=(on_outputs,), name="stallfree-core-reader", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def send(self, message: CoreMessage) -> None:
        self._outbox.put(message)

    def is_alive(self) -> bool:
        return self._process.poll() is None and self._reader.is_alive()

    def shutdown(self) -> None:
        self._closing = True
        self._outbox.put(SHUTDOWN)
        try:
            self._process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _send_messages(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the core is gone: its reader reports that
                return
            if message == SHUTDOWN:
                return

    def _read_outputs(self, on_outputs: OnOutputs) -> None:
        while True:
            try:
                outputs = self._conn.recv()
            except (EOFError, OSError):
                break
            assert isinstance(outputs, EngineOutputs)
            on_outputs(outputs)
            if outputs.dead is not None:
                return
        try:
            code = self._process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        if not self._closing:
            on_outputs(EngineOutputs([], None, dead=f"the engine core process exited (code {code})"))


def main(fd: int) -> None:
    """Build the core, say it is ready, run the loop until SHUTDOWN or until the frontend's end
    of the socket closes (the frontend died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle
    log_format = "%(asctime)s %(levelname)s engine-core %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=log_format)
    conn = Channel(fd)
    args = conn.recv()
    assert isinstance(args, CoreArgs)
    torch.set_num_threads(args.num_threads)
    sink = BufferedSink()
    metrics = EngineMetrics(sink, args.model_name) if args.model_name is not None else None
    try:
        # The input processor is built too: its grammar compiler rebuilds requests' grammars here.
        core, _ = build_engine(args.config, metrics)
    except BaseException as error:
        try:
            conn.send(CoreFailed(error))
        except Exception:  # an error that does not pickle
            conn.send(CoreFailed(RuntimeError(repr(error))))
        return
    conn.send(CoreReady(core.kv_cache_manager.num_blocks))

    def receive(timeout: float | None) -> CoreMessage | None:
        try:
            if not conn.poll(timeout or 0):
                return None
            message = conn.recv()
        except (EOFError, OSError):
            return SHUTDOWN
        return message  # type: ignore[return-value]

    def emit(outputs: EngineOutputs) -> None:
        with contextlib.suppress(OSError, ValueError):  # the frontend is gone; the next receive says so
            conn.send(outputs)

    CoreLoop(core, receive, emit, sink.drain if metrics is not None else list).run()


if __name__ == "__main__":
    # By its importable name: what it pickles must name `replica_engine.core_process`, not `__main__`.
    from replica_engine.core_process import main as core_main

    core_main(int(sys.argv[1]))
    os._exit(0)  # no waiting on non-daemon threads a library may have left
