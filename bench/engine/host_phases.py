"""Where the step thread's time goes, phase by phase: each engine method on a step's path timed
where it is called (a wrapper on the instance, removed afterwards), so a benchmark can say whether
a step waits on the device or the device waits on the host, and for which part of the host's work.

On a GPU, `submit` is the host building the step's inputs and queueing its kernels, and `collect`
is the host waiting for a step's sampled tokens: with async scheduling a step whose `collect` is
near zero found its tokens ready, so the device had waited on the host. On a CPU `submit`
computes the step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter

from replica_engine import LLMEngine

PHASES = ("schedule", "submit", "collect", "update", "outputs")


def _targets(engine: LLMEngine) -> dict[str, tuple[object, str]]:
    """Each phase's (object, method name)."""
    core = engine.core
    return {
        "schedule": (core.scheduler, "schedule"),
        "submit": (core.runner, "submit"),
        "collect": (core.runner, "collect"),
        "update": (core, "_update"),  # the scheduler's update and the core's outputs
        "outputs": (engine, "_process"),  # the user's view: text, stop strings
    }


@contextmanager
def host_phases(engine: LLMEngine) -> Iterator[Counter[str]]:
    """Seconds in each of PHASES while the block runs (added up over its steps)."""
    seconds: Counter[str] = Counter()
    targets = _targets(engine)

    def timed(phase: str, method: Callable) -> Callable:
        def run(*args: object, **kwargs: object) -> object:
            started = perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[phase] += perf_counter() - started

        return run

    for phase, (owner, name) in targets.items():
        setattr(owner, name, timed(phase, getattr(owner, name)))
    try:
        yield seconds
    finally:
        for owner, name in targets.values():
            delattr(owner, name)  # the class's method again
