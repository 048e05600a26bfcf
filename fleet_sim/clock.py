"""A virtual clock and the events due on it."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    """Callbacks run in time order; events due at the same time run in the order they were
    scheduled, so a run is the same every time."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        if when < self.now:
            raise ValueError(f"when: {when} is before the clock's now ({self.now})")
        heapq.heappush(self._queue, (when, next(self._order), callback))

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        self.call_at(self.now + delay, callback)

    def run(self, until: float | None = None) -> None:
        """Run events until none is left, or until the next is due after `until` (the clock
        then stands at `until`)."""
        while self._queue and (until is None or self._queue[0][0] <= until):
            self.now, _, callback = heapq.heappop(self._queue)
            callback()
        if until is not None:
            self.now = max(self.now, until)

    @property
    def num_pending(self) -> int:
        return len(self._queue)
