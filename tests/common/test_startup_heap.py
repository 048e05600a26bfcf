"""freeze_startup_heap: what a process holds when it is up leaves the collector's walk; garbage made
later is still collected."""

from __future__ import annotations

import gc
import weakref

from common.startup_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_the_startup_heap_leaves_the_walk_and_later_cycles_are_still_collected():
    startup = _Node()
    freeze_startup_heap()
    assert id(startup) not in {id(o) for o in gc.get_objects()}

    later = _Node()
    gone = weakref.ref(later)
    del later
    gc.collect()
    assert gone() is None
