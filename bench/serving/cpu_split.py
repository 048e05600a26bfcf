"""Where the cores went during a run: CPU seconds per process, grouped by what the process is
(a Serve replica by its deployment, Ray's proxy and controller, this load generator, a peer's
server by its name). Processes that start and end inside the run are not seen."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil

TOP = 6  # groups named in the result; the rest are summed


def _label(process: psutil.Process) -> str:
    """What a process is: a Ray worker by its actor, a Python module run with -m by the module
    (an engine core's process), else its name."""
    if process.pid == os.getpid():
        return "load generator (this process)"
    cmdline = process.cmdline()
    if cmdline and cmdline[0].startswith("ray::"):  # Ray workers name themselves by actor
        return cmdline[0].removeprefix("ray::").split(".")[0]
    if "-m" in cmdline[1:-1]:
        return f"python -m {cmdline[cmdline.index('-m', 1) + 1]}"
    return process.name()


def cpu_seconds(processes: Iterable[psutil.Process]) -> dict[int, tuple[str, float]]:
    """pid -> (label, CPU seconds so far) of those of `processes` still alive."""
    seen = {}
    for process in processes:
        try:
            times = process.cpu_times()
            seen[process.pid] = (_label(process), times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return seen


@contextmanager
def cpu_split() -> Iterator[dict[str, Any]]:
    """`with cpu_split() as split:` ... ; afterwards `split` holds the block's "wall_s", the
    machine's "cores", and "by_process": per group (the TOP largest, then "the rest") its CPU
    seconds and their share of the machine's core-seconds."""
    split: dict[str, Any] = {}
    before = cpu_seconds(psutil.process_iter())
    started = time.monotonic()
    yield split
    wall_s = time.monotonic() - started
    by_group: Counter[str] = Counter()
    for pid, (group, seconds) in cpu_seconds(psutil.process_iter()).items():
        by_group[group] += seconds - before.get(pid, (group, 0.0))[1]
    named = {group: seconds for group, seconds in by_group.most_common(TOP) if seconds >= 0.01}
    named["the rest"] = sum(by_group.values()) - sum(named.values())
    cores = psutil.cpu_count() or 1
    split["wall_s"] = round(wall_s, 2)
    split["cores"] = cores
    split["by_process"] = {
        group: {"cpu_s": round(seconds, 2), "share_of_cores": round(seconds / (wall_s * cores), 4)}
        for group, seconds in named.items()
    }
