"""KV pressure, predicted per replica: the pure part of the router (no Ray), unit-tested alone.

A replica reports its KV blocks every ~0.5 s. Between reports this router corrects the report
with what it sent there since (prompt + expected output, in blocks), and with what finished
there since: a conversation's next turn is sent the moment its last one ends, when the latest
report still shows the last turn's blocks in use. A request counts from the moment it is ranked
onto a replica, not from when the replica accepts it: Serve routes a burst concurrently, and
every choice made before the first acceptance would otherwise see the same pressures.

Every time here is this router's own monotonic clock: a report is dated by when this router first
saw it (a replica numbers its reports), never by the replica's clock, so clock skew between
nodes cannot make fresh reports look stale or stale ones fresh."""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

from common.routing_stats import RoutingStats

STALE_AFTER_S = 2.0  # four missed reports at the 0.5 s period
# A report received this long after a request was sent or finished was taken after it (0.5 s
# period plus the controller's broadcast): it counts the request's blocks, or no longer counts the
# ones it freed. One received sooner may be older than the send (a full test run saw a short
# request steered onto a replica whose pre-send report, arriving just after, wiped its long one).
REPORT_LAG_S = 1.0
# A request a report counts is remembered until it finishes, or this long (a request cancelled
# before a replica accepted it is never reported finished).
MAX_IN_FLIGHT_S = 600.0

# Why a replica was ranked where it was (the routing metric's `reason` label).
BY_KV = "kv"  # fresh stats: ranked by predicted KV pressure
BY_QUEUE = "queue-fallback"  # stale stats: ranked by queue length, after every fresh replica
NO_STATS = "no-stats"  # never reported: as stale


@dataclass
class _Sent:
    replica: Hashable
    num_tokens: int  # KV tokens it will hold there
    sent_at: float
    prefill_tokens: int = 0  # prompt tokens it will compute there
    reported: bool = False  # a report received REPORT_LAG_S after it was sent counts it


@dataclass
class _Freed:
    num_tokens: int
    finished_at: float


@dataclass
class _Received:
    report_seq: int
    received_at: float


@dataclass
class PressureTracker:
    """In-flight bookkeeping of one router (each Ingress replica has its own). Indexed per replica,
    so that a decision costs the requests sent since the latest reports, not all in flight."""

    stale_after_s: float = STALE_AFTER_S
    _sent: dict[Hashable, _Sent] = field(default_factory=dict)  # request id -> what it asks for, oldest first
    _unreported: dict[Hashable, dict[Hashable, _Sent]] = field(default_factory=dict)  # replica -> id -> sent
    _unfinished: dict[Hashable, int] = field(default_factory=dict)  # replica -> requests sent, not finished
    _freed: dict[Hashable, list[_Freed]] = field(default_factory=dict)  # replica -> finished since
    _received: dict[Hashable, _Received] = field(default_factory=dict)  # replica -> its latest report

    def observe(self, replica: Hashable, load: RoutingStats, now: float | None = None) -> float:
        """When this router first saw `load` (now, if it is a new report)."""
        seen = self._received.get(replica)
        if seen is None or seen.report_seq != load.report_seq:
            seen = self._received[replica] = _Received(load.report_seq, _now(now))
            unreported = self._unreported.get(replica, {})
            for request_id, sent in list(unreported.items()):
                if seen.received_at - sent.sent_at >= REPORT_LAG_S:
                    sent.reported = True
                    del unreported[request_id]
            while self._sent:  # oldest first: forget what was never reported finished
                request_id, sent = next(iter(self._sent.items()))
                if seen.received_at - sent.sent_at < MAX_IN_FLIGHT_S:
                    break
                self._forget(request_id)
            self._freed[replica] = [
                f for f in self._freed.get(replica, []) if seen.received_at - f.finished_at < REPORT_LAG_S
            ]
        return seen.received_at

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        """Forget the reports of replicas that are gone."""
        current = set(replicas)
        self._received = {r: seen for r, seen in self._received.items() if r in current}
        self._freed = {r: freed for r, freed in self._freed.items() if r in current}

    def on_sent(
        self,
        request_id: Hashable,
        replica: Hashable,
        num_tokens: int,
        now: float | None = None,
        prefill_tokens: int = 0,
    ) -> None:
        self._forget(request_id)  # ranked onto one replica, routed to another: it counts there
        sent = self._sent[request_id] = _Sent(replica, num_tokens, _now(now), prefill_tokens)
        self._unreported.setdefault(replica, {})[request_id] = sent
        self._unfinished[replica] = self._unfinished.get(replica, 0) + 1

    def on_finished(self, request_id: Hashable, now: float | None = None) -> None:
        sent = self._forget(request_id)
        if sent is not None and sent.reported:  # the replica's reports still count its blocks
            self._freed.setdefault(sent.replica, []).append(_Freed(sent.num_tokens, _now(now)))

    def _forget(self, request_id: Hashable) -> _Sent | None:
        sent = self._sent.pop(request_id, None)
        if sent is not None:
            self._unreported.get(sent.replica, {}).pop(request_id, None)
            self._unfinished[sent.replica] -= 1
        return sent

    def in_flight_tokens(self, replica: Hashable) -> int:
        """Tokens sent to `replica` that its latest report cannot know."""
        return sum(s.num_tokens for s in self._unreported.get(replica, {}).values())

    def in_flight_prefill_tokens(self, replica: Hashable) -> int:
        """Prompt tokens sent to `replica` that its latest report cannot know."""
        return sum(s.prefill_tokens for s in self._unreported.get(replica, {}).values())

    def freed_tokens(self, replica: Hashable) -> int:
        """Tokens of requests that finished on `replica` after its latest report counted them."""
        return sum(f.num_tokens for f in self._freed.get(replica, []))

    def in_flight_requests(self, replica: Hashable) -> int:
        """Requests sent to `replica` that its latest report cannot know."""
        return len(self._unreported.get(replica, {}))

    def unfinished_requests(self, replica: Hashable) -> int:
        """Requests this router sent to `replica` that have not finished, reported or not."""
        return self._unfinished.get(replica, 0)

    def pressure(self, replica: Hashable, load: RoutingStats, now: float | None = None) -> float:
        self.observe(replica, load, now)
        in_flight_blocks = math.ceil(self.in_flight_tokens(replica) / load.block_size)
        freed_blocks = self.freed_tokens(replica) // load.block_size
        used = max(0, load.used_blocks() + in_flight_blocks - freed_blocks)
        return used / max(1, load.num_total_blocks)

    def reason(self, replica: Hashable, load: RoutingStats | None, now: float | None = None) -> str:
        """How a replica with this report ranks: by KV pressure if it is fresh, else by queue."""
        if load is None:
            return NO_STATS
        now = _now(now)
        return BY_KV if now - self.observe(replica, load, now) <= self.stale_after_s else BY_QUEUE

    def rank(
        self,
        replicas: Iterable[Hashable],
        stats: Mapping[Hashable, RoutingStats | None],
        queue_lens: Mapping[Hashable, int],
        now: float | None = None,
    ) -> list[tuple[Hashable, str]]:
        """Replicas best first, each with the reason for its place: fresh stats by predicted KV
        pressure (ties: shorter queue), then the rest by queue length (unknown: last; ties: fewer
        of this router's requests unfinished there, so a burst ranked on stale reports and one
        cached queue length still spreads)."""
        now = _now(now)
        fresh, fallback = [], []
        for replica in replicas:
            load = stats.get(replica)
            queue_len = queue_lens.get(replica, math.inf)
            reason = self.reason(replica, load, now)
            if reason == BY_KV:
                assert load is not None
                fresh.append(((self.pressure(replica, load, now), queue_len), replica, reason))
            else:
                fallback.append(((queue_len, self.unfinished_requests(replica)), replica, reason))
        fresh.sort(key=lambda entry: entry[0])
        fallback.sort(key=lambda entry: entry[0])
        return [(replica, reason) for _, replica, reason in fresh + fallback]


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
