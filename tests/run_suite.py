"""`make test`'s suite: the Ray tests and the rest in two pytest processes at once.

The Ray tests spend much of their time waiting (clusters and replicas starting, autoscaling,
metrics reports) with the cores idle; the rest keep the cores busy. So the rest run beside them at
the lowest priority and take what the cores have left, while the Ray tests, which wait on state
with deadlines, run as if alone. The rest run in a session of their own whose scheduling group is
set to nice 19: Linux weighs each session's processes together (autogroups), so a process's own
nice value would not yield to Ray's workers in other sessions. (As equals the two took longer, and
the rest on one torch thread longer still.) The rest's output is printed once both end; Ctrl-C
stops both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

PYTEST = [sys.executable, "-m", "pytest", "-q"]


def _lowest_priority() -> None:
    """In the child, in its new session, before it runs pytest: weighted as nice 19."""
    # the session's scheduling group (without autogroups, the process's own nice value counts)
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text("19")
    os.nice(19)


def main(args: list[str]) -> int:
    with tempfile.TemporaryFile(mode="w+") as rest_log:
        rest = subprocess.Popen(
            [*PYTEST, "-m", "not ray", *args],
            stdout=rest_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_lowest_priority,
        )
        # Ctrl-C reaches the Ray tests (the terminal's foreground), not the rest's own session
        signal.signal(signal.SIGINT, lambda *_: os.killpg(rest.pid, signal.SIGINT))
        try:
            ray_code = subprocess.Popen([*PYTEST, "-m", "ray", *args]).wait()
            rest_code = rest.wait()
        finally:
            if rest.poll() is None:  # this process was stopped
                os.killpg(rest.pid, signal.SIGTERM)
                rest.wait()
        rest_log.seek(0)
        print("\n==== the tests without Ray (run beside the Ray tests) ====", flush=True)
        sys.stdout.write(rest_log.read())
    print(f"\nRay tests: exit {ray_code}; the rest: exit {rest_code}")
    return max(_failed(ray_code, args), _failed(rest_code, args))


def _failed(code: int, args: list[str]) -> int:
    """pytest's exit code, but for "no tests collected" (5) where arguments chose the tests: they
    may leave a half empty. The whole suite has tests in both."""
    return 0 if args and code == pytest.ExitCode.NO_TESTS_COLLECTED else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
