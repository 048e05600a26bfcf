"""What every simulated deployment does between a router and its replicas, as Serve does it: a
request goes to the first replica in the router's ranking below max_ongoing_requests, or waits at
the router, in arrival order, until one is; each replica reports its routing stats every period."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable

from fleet_sim.clock import EventLoop
from fleet_sim.replica import SimReplica
from fleet_sim.routers import SimRouter
from fleet_sim.trace import SimRequest

Start = Callable[[SimReplica], None]  # hands the request to the replica the router picked


class RouterQueue:
    def __init__(self, router: SimRouter, replicas: list[SimReplica], limit: int, loop: EventLoop) -> None:
        self.router = router
        self.replicas = replicas  # taking requests (the caller's list: it adds and removes them)
        self.limit = limit  # max_ongoing_requests
        self.loop = loop
        self._waiting: deque[tuple[SimRequest, Start]] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def push(self, request: SimRequest, start: Start) -> None:
        self._waiting.append((request, start))
        self.dispatch()

    def dispatch(self) -> None:
        """Route waiting requests in arrival order; the first one none of its ranked replicas has
        room for waits, and the ones behind it, until a request finishes."""
        while self._waiting and any(replica.num_ongoing < self.limit for replica in self.replicas):
            request, start = self._waiting[0]
            ranked = self.router.rank(request, self.replicas, self.loop.now)
            replica = next((r for r in ranked if r.num_ongoing < self.limit), None)
            if replica is None:
                return
            self._waiting.popleft()
            self.router.on_routed(request, replica, self.loop.now)
            start(replica)

    def report_every(
        self, replica: SimReplica, period_s: float, delay_s: float, going: Callable[[], bool]
    ) -> None:
        """The replica's routing report reaches the router `delay_s` after each period, while
        `going()` and the replica takes requests."""
        if not going() or replica not in self.replicas:
            return
        deliver = functools.partial(self.router.on_report, replica.replica_id, replica.report())
        self.loop.call_later(delay_s, lambda: deliver(self.loop.now))
        again = functools.partial(self.report_every, replica, period_s, delay_s, going)
        self.loop.call_later(period_s, again)
