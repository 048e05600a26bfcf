#!/usr/bin/env bash
# `make test`'s pytest: the tests that start Ray and those that do not, as two pytest processes
# side by side. The Ray side mostly waits on Serve (deploys, health checks, autoscaling delays,
# nodes starting); the other side's engine and kernel tests fill those waits. One after the other
# they ran past the suite's 20 minutes on 2 cores. Arguments go to both (-x, -k, ...).
#
# The Ray side runs in the foreground, its output live: a background job of a script ignores
# Ctrl-C, and so would its children, such as the `make serve` a test stops with Ctrl-C. The other
# side's output follows. Either side failing fails the run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
without_ray_log=$(mktemp)
"$PY" -m pytest -q -m "not ray" "$@" >"$without_ray_log" 2>&1 &
without_ray=$!
trap 'kill "$without_ray" 2>/dev/null; rm -f "$without_ray_log"' EXIT
echo "---- the tests that start Ray (the others run beside them: their output follows) ----"
"$PY" -m pytest -q -m ray "$@"
with_ray_status=$?
wait "$without_ray"
without_ray_status=$?
echo "---- the tests without Ray ----"
cat "$without_ray_log"
exit $((with_ray_status || without_ray_status))
