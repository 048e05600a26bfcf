"""How a load's requests are paced, whatever carries them (HTTP, or an engine in this process):
open loop (each at its arrival time) or closed loop (N clients, each sending its next request
when its last one ends)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar


class Scheduled(Protocol):
    @property
    def at_s(self) -> float: ...  # from the run's start


Item = TypeVar("Item")
ScheduledItem = TypeVar("ScheduledItem", bound=Scheduled)
Result = TypeVar("Result")


async def sleep_until(moment: float) -> None:
    await asyncio.sleep(max(0.0, moment - time.monotonic()))


async def open_loop(
    send: Callable[[ScheduledItem], Awaitable[Result]], items: Sequence[ScheduledItem], rate: float = 1.0
) -> tuple[float, list[Result]]:
    """Each item sent `at_s / rate` after the start, whatever the server is doing: the wall time
    and each item's result, in the items' order."""

    async def at_its_time(item: ScheduledItem, start: float) -> Result:
        await sleep_until(start + item.at_s / rate)
        return await send(item)

    start = time.monotonic()
    results = await asyncio.gather(*(at_its_time(item, start) for item in items))
    return time.monotonic() - start, list(results)


async def closed_loop(
    send: Callable[[Item], Awaitable[Result]], items: Sequence[Item], concurrency: int
) -> tuple[float, list[Result]]:
    """`concurrency` clients take the items in order, each sending the next as its last ends: the
    wall time and each item's result, in the items' order."""
    pending = list(reversed(range(len(items))))
    results: dict[int, Result] = {}

    async def client() -> None:
        while pending:
            index = pending.pop()
            results[index] = await send(items[index])

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.monotonic() - start, [results[index] for index in range(len(items))]
