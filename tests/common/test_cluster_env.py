"""The Serve settings `make serve` runs with are the ones the test clusters and benchmarks run
with, and the ones the deployment docs tell a user's cluster to set: one list, three places."""

from __future__ import annotations

import re
from pathlib import Path

from harness.serve_cluster import BENCH_CLUSTER_ENV

REPO = Path(__file__).resolve().parents[2]


def serve_env() -> dict[str, str]:
    makefile = (REPO / "Makefile").read_text().splitlines()
    [line] = [line for line in makefile if line.startswith("SERVE_ENV :=")]
    return dict(setting.split("=", 1) for setting in line.split(":=", 1)[1].split())


def test_make_serve_runs_the_settings_the_tests_and_benchmarks_run():
    settings = serve_env()
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" in settings
    assert {name: BENCH_CLUSTER_ENV.get(name) for name in settings} == settings


def test_the_deployment_docs_export_every_one_of_them():
    docs = (REPO / "docs" / "deployment.md").read_text()
    exported = dict(re.findall(r"^export (RAY_SERVE_\w+)=(\S+)", docs, re.M))
    assert exported == serve_env()
