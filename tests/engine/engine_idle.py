"""Waiting for an AsyncEngine to let go of everything: an abort takes effect at the end of the
step that was running when it came (the step thread owns the engine's state), so tests give it
that long, bounded, instead of reading the state at once."""

from __future__ import annotations

import time
from collections.abc import Callable

from replica_engine import EngineStats


def is_idle(stats: EngineStats) -> bool:
    return stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks


def wait_idle(stats: Callable[[], EngineStats], timeout_s: float = 10.0) -> float:
    """Seconds until `stats()` shows no request and no block held; fails after `timeout_s` (a
    deadline on state: a step or two, milliseconds, on an idle machine)."""
    started = time.monotonic()
    while not is_idle(latest := stats()):
        assert time.monotonic() - started < timeout_s, f"still held after {timeout_s} s: {latest}"
        time.sleep(0.005)
    return time.monotonic() - started
