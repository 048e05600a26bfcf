"""Routing by LoRA adapter, pure (no Ray): a request run with an adapter goes first to a replica
that holds it loaded, unless that replica is overloaded; then as the ranking without the adapter
says (kv_prefix: prefix, then load; kv_pressure: load).

Why holders first: a replica loads an adapter from disk on the step that first needs it (that
step stalls for the load), and each one it loads takes a place in its host LRU (max_cpu_loras),
evicting another. Routed by load alone, every adapter ends up loaded on every replica, evicting
each other. Why not blindly: a holder too busy by SGLang's balance rule (more requests than the
least busy replica by both a slack and a fraction), or whose KV pool is predicted full while
another replica's is not, is passed over; the replica the request lands on then loads the adapter
and holds it too, so a hot adapter spreads over as many replicas as its load needs while a cold
one stays on one.

Why late reports still count: which adapters a replica holds changes only when it loads or evicts
one, so a report older than the KV-pressure staleness limit (2 s, which a loaded host's live
replicas overrun) still says where an adapter is; its load is judged on that report plus what this
router sent there since. A replica silent for longer than Serve's health-check period may be gone,
and is no holder (fresh holders rank before late ones either way).

Who holds what: each replica's latest report (the names of its loaded adapters), plus what this
router sent there since (a burst of one adapter must see where its first request went before any
report says so), remembered until a report lists it or for RECENT_TTL_S at most."""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from common.routing_stats import RoutingStats
from router.prefix_index import RECENT_TTL_S
from router.pressure import NO_STATS, PressureTracker

BY_ADAPTER = "adapter-hit"  # the replica holds the request's adapter and is not overloaded


@dataclass(frozen=True)
class AdapterPolicy:
    # A holder is overloaded when it has more requests than the least busy replica by both this
    # many and this fraction of its count (SGLang's cache-aware router's balance rule; its slack).
    request_slack: int = 32
    max_request_imbalance: float = 0.5
    # ...or when its predicted KV pressure is at least this while another replica's is below: the
    # request would wait there for blocks, which costs more than an adapter load.
    max_pressure: float = 1.0
    # A holder whose latest report is older than this (Serve's default health-check period) may be
    # gone: it is passed over like a replica that never reported.
    max_report_age_s: float = 10.0


@dataclass
class AdapterIndex:
    recent_ttl_s: float = RECENT_TTL_S
    _reported: dict[Hashable, tuple[int, frozenset[str]]] = field(default_factory=dict)  # (seq, names)
    _recent: dict[Hashable, dict[str, float]] = field(default_factory=dict)  # replica -> name -> sent at

    def observe(self, replica: Hashable, stats: RoutingStats) -> None:
        seen = self._reported.get(replica)
        if seen is not None and seen[0] == stats.report_seq:
            return
        names = frozenset(stats.lora_adapters)
        self._reported[replica] = stats.report_seq, names
        recent = self._recent.get(replica)
        if recent:  # listed now: the reports say from here on whether it stays loaded
            for name in names & recent.keys():
                del recent[name]

    def on_sent(self, replica: Hashable, name: str, now: float | None = None) -> None:
        self._recent.setdefault(replica, {})[name] = _now(now)

    def reported(self, replica: Hashable, name: str) -> bool:
        seen = self._reported.get(replica)
        return seen is not None and name in seen[1]

    def holds(self, replica: Hashable, name: str, now: float | None = None) -> bool:
        """It holds the adapter, or will once the request this router sent it runs."""
        sent_at = self._recent.get(replica, {}).get(name)
        recent = sent_at is not None and _now(now) - sent_at <= self.recent_ttl_s
        return recent or self.reported(replica, name)

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        current = set(replicas)
        self._reported = {r: seen for r, seen in self._reported.items() if r in current}
        self._recent = {r: recent for r, recent in self._recent.items() if r in current}


def prefer_holders(
    policy: AdapterPolicy,
    tracker: PressureTracker,
    index: AdapterIndex,
    stats: Mapping[Hashable, RoutingStats | None],
    ranking: Sequence[tuple[Hashable, str]],
    adapter: str,
    now: float,
) -> list[tuple[Hashable, str]]:
    """`ranking` (best first, without regard to the adapter) with the replicas that hold `adapter`,
    have reported within `max_report_age_s` and are not overloaded moved to the front, in their
    order; unchanged if none."""
    age_limit = policy.max_report_age_s
    known = [
        replica
        for replica, reason in ranking
        if reason != NO_STATS and now - tracker.observe(replica, stats[replica], now) <= age_limit
    ]
    holders = [replica for replica in known if index.holds(replica, adapter, now)]
    if not holders:
        return list(ranking)
    loads = {replica: _load(tracker, replica, stats[replica], now) for replica in known}
    least_requests = min(requests for requests, _ in loads.values())
    room = any(loads[r][1] < policy.max_pressure for r in known if r not in holders)

    def overloaded(replica: Hashable) -> bool:
        requests, pressure = loads[replica]
        excess = requests - least_requests
        too_busy = excess > policy.request_slack and requests > least_requests * (
            1 + policy.max_request_imbalance
        )
        return too_busy or (pressure >= policy.max_pressure and room)

    preferred = [replica for replica in holders if not overloaded(replica)]
    rest = [(replica, reason) for replica, reason in ranking if replica not in preferred]
    return [(replica, BY_ADAPTER) for replica in preferred] + rest


def _load(
    tracker: PressureTracker, replica: Hashable, stats: RoutingStats | None, now: float
) -> tuple[int, float]:
    """(requests there: reported and sent since, predicted KV pressure)."""
    assert stats is not None  # it has reported
    requests = stats.num_waiting + stats.num_running + tracker.in_flight_requests(replica)
    return requests, tracker.pressure(replica, stats, now)


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
