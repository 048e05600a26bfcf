"""`ingress: colocated`: the engine replica inside the Ingress's own process, so that a request
and each of its tokens cross no Ray hop (HTTP -> the Ingress replica -> its engine). The Ingress
calls it as it calls the EngineReplica deployment's handle: `InProcessEngine` answers the same
calls (`.options(stream=True).generate.remote(...)` and the rest) on the Ingress's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the Ingress's module imports this one, and no torch
    from replica_engine.config import EngineConfig


@dataclass(frozen=True)
class ColocatedReplica:
    """What the Ingress builds its in-process EngineReplica from (EngineReplica's arguments)."""

    engine_config: EngineConfig
    model_name: str
    cpu_threads: int | None = None


class StreamCall:
    """A streaming call, as the Ingress uses Serve's DeploymentResponseGenerator: iterated, and
    cancelled when the Ingress is done with it (closing the replica's generator aborts its
    requests, as Serve's cancel does on a replica)."""

    def __init__(self, items: AsyncGenerator[Any, None]) -> None:
        self._items = items
        self._closing: asyncio.Task | None = None

    def __aiter__(self) -> StreamCall:
        return self

    async def __anext__(self) -> Any:
        return await self._items.__anext__()

    def cancel(self) -> None:
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close())

    async def _close(self) -> None:
        with contextlib.suppress(RuntimeError):  # still running: its cancelled await closes it
            await self._items.aclose()


class LocalMethod:
    """A method of this process, called as a handle's is: `.remote(...)` (a StreamCall where it
    streams)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function

    def remote(self, *args: Any) -> Any:
        if inspect.isasyncgenfunction(self._function):
            return StreamCall(self._function(*args))
        return self._result(*args)

    async def _result(self, *args: Any) -> Any:
        result = self._function(*args)
        return await result if inspect.isawaitable(result) else result


class InProcessEngine:
    """An EngineReplica instance behind the calls the Ingress makes of the deployment's handle."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica

    def options(self, stream: bool = False) -> InProcessEngine:
        return self  # whether a method streams is its own: an async generator does

    def __getattr__(self, name: str) -> LocalMethod:
        return LocalMethod(getattr(self.replica, name))


def build_in_process_engine(spec: ColocatedReplica) -> InProcessEngine:
    """The EngineReplica deployment's class, built here (its module imports the engine: torch)."""
    from deployments.engine_replica import EngineReplica

    replica_class = EngineReplica.func_or_class
    return InProcessEngine(replica_class(spec.engine_config, spec.model_name, spec.cpu_threads))
