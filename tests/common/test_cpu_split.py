"""bench.serving.cpu_split: where the cores went during a block, by process."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from bench.serving.cpu_split import cpu_split

DEADLINE_S = 120  # a hang detector: the child takes its first 0.2 s of CPU at once on an idle machine


def test_a_split_names_this_process_and_a_python_module_by_its_module():
    """A Python module run with -m (as an engine core's process is) goes by its module, this
    process by its role; both are counted while they run."""
    child = subprocess.Popen([sys.executable, "-m", "timeit", "-n", "1000000000", "pass"])
    try:
        process = psutil.Process(child.pid)
        with cpu_split() as split:
            deadline = time.monotonic() + DEADLINE_S
            while sum(process.cpu_times()[:2]) < 0.2:  # the child works inside the block
                assert time.monotonic() < deadline, "the child took no CPU"
                time.sleep(0.05)
            sum(i * i for i in range(2_000_000))  # and so does this process (~0.2 s: among the largest)
    finally:
        child.kill()
        child.wait()
    by_process = split["by_process"]
    assert by_process["python -m timeit"]["cpu_s"] > 0, by_process
    assert by_process["load generator (this process)"]["cpu_s"] > 0, by_process
    assert split["wall_s"] > 0 and split["cores"] == psutil.cpu_count()
