"""The waiting queue, in admission order: lower priority value first, then arrival (vLLM's priority
policy). Kept sorted as requests enter, so a step reads and takes requests from its front."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from replica_engine.request import Request


def admission_key(request: Request) -> tuple[int, int]:
    """Smaller is served first; the largest running request is the first to preempt."""
    return request.sampling_params.priority, request.arrival_seq


@dataclass
class WaitingQueue:
    _requests: deque[Request] = field(default_factory=deque)
    # Each request's prompt tokens to compute, less the cache hits expected, as it entered: they
    # do not change while it waits (it holds no blocks and samples nothing). Their sum, kept as
    # requests come and go, is read every step and on every arrival (the load reports).
    _pending: dict[Request, int] = field(default_factory=dict)
    num_pending_tokens: int = 0

    def push(self, request: Request) -> None:
        """A new arrival, or a preempted request going back by its original arrival."""
        pending = request.num_owed_tokens - request.num_expected_cached_tokens
        self._pending[request] = pending
        self.num_pending_tokens += pending
        self._insert(request)

    def _insert(self, request: Request) -> None:
        """At one priority this is always an append (new) or an appendleft (preempted), as plain FCFS."""
        key, queue = admission_key(request), self._requests
        if not queue or admission_key(queue[-1]) <= key:
            queue.append(request)
        elif key < admission_key(queue[0]):
            queue.appendleft(request)
        else:
            queue.insert(bisect.bisect_right(queue, key, key=admission_key), request)

    def at(self, index: int) -> Request:
        """The request `index` places from the front (0: the next to admit)."""
        return self._requests[index]

    def remove(self, request: Request) -> None:
        """Out of the queue: admitted (from near the front: the search stops there) or aborted."""
        self._requests.remove(request)
        self.num_pending_tokens -= self._pending.pop(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)
