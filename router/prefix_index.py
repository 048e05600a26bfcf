"""Which prompt blocks each replica holds, as this router knows it: the replica's latest reported
BlockSummary (common/block_summary.py) plus the prompts this router sent it since, which will be
cached there by the time the next request of the same conversation arrives.

A sent prompt's keys are remembered until a report that holds them arrives (the summary covers
them from then on) or for RECENT_TTL_S at most (the replica may have evicted them, or never
admitted the request). Pure: no Ray, unit-tested alone; times are this router's monotonic clock."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from common.block_hash import BlockHash
from common.block_summary import BlockSummary
from common.routing_stats import RoutingStats

RECENT_TTL_S = 10.0
MAX_RECENT_KEYS = 1 << 16  # per replica: a bound on this router's memory, not a tuning knob


@dataclass
class _Held:
    report_seq: int
    summary: BlockSummary
    hash_root: BlockHash


@dataclass
class PrefixIndex:
    recent_ttl_s: float = RECENT_TTL_S
    _held: dict[Hashable, _Held] = field(default_factory=dict)  # replica -> its latest summary
    _recent: dict[Hashable, OrderedDict[BlockHash, float]] = field(default_factory=dict)  # -> sent at

    def observe(self, replica: Hashable, stats: RoutingStats) -> None:
        """A replica's report: its summary replaces the last one, and sent keys it holds go."""
        held = self._held.get(replica)
        if held is not None and held.report_seq == stats.report_seq:
            return
        summary = stats.block_summary
        self._held[replica] = _Held(stats.report_seq, summary, stats.hash_root)
        recent = self._recent.get(replica)
        if recent:
            keys = list(recent)
            for key, held_now in zip(keys, summary.contains_each(keys), strict=True):
                if held_now:
                    del recent[key]

    def hash_root(self, replicas: Iterable[Hashable]) -> BlockHash | None:
        """The chain root (model, no salt) the replicas report; None if none reports one."""
        return next((self._held[r].hash_root for r in replicas if r in self._held), None)

    def on_sent(self, replica: Hashable, keys: Sequence[BlockHash], now: float | None = None) -> None:
        recent = self._recent.setdefault(replica, OrderedDict())
        sent_at = _now(now)
        for key in keys:
            recent[key] = sent_at
            recent.move_to_end(key)
        while len(recent) > MAX_RECENT_KEYS:
            recent.popitem(last=False)

    def overlap(self, replica: Hashable, keys: Sequence[BlockHash], now: float | None = None) -> int:
        """How many of the prompt's leading blocks `replica` holds (or soon will): a chain is
        reusable only up to its first missing block."""
        if not keys:
            return 0
        held = self._held.get(replica)
        recent = self._recent.get(replica)
        if recent:
            oldest = _now(now) - self.recent_ttl_s
            while recent and next(iter(recent.values())) < oldest:
                recent.popitem(last=False)
        if (held is None or keys[0] not in held.summary) and (not recent or keys[0] not in recent):
            return 0  # most replicas, for most prompts: one lookup, not one per block
        found = held.summary.contains_each(keys) if held is not None else np.zeros(len(keys), dtype=bool)
        if recent:
            found |= np.fromiter((key in recent for key in keys), dtype=bool, count=len(keys))
        misses = np.flatnonzero(~found)
        return int(misses[0]) if misses.size else len(keys)

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        """Forget replicas that are gone (a restarted replica comes back with a new id, empty)."""
        current = set(replicas)
        self._held = {r: held for r, held in self._held.items() if r in current}
        self._recent = {r: recent for r, recent in self._recent.items() if r in current}


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
