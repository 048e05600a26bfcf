"""One entry point for every benchmark: `python -m bench NAME` runs the module of that name in
its group, `python -m bench` lists them, and every result file says how to rerun it that way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import catalog
from bench.driver import result_header

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_every_runnable_module_is_a_benchmark_of_its_group():
    found = catalog.benchmarks()
    runnable = {
        path.stem: path.parent.name
        for group in catalog.GROUPS
        for path in (catalog.BENCH / group).glob("*.py")
        if catalog.runs_as_command(path.read_text())
    }
    assert {name: b.group for name, b in found.items()} == runnable
    assert {"cpu_serving", "gpu", "fleet", "tool_calls", "capacity"} <= found.keys()
    # No benchmark is left loose beside the groups: bench/ itself holds only what they share.
    loose = [p.name for p in catalog.BENCH.glob("*.py") if catalog.runs_as_command(p.read_text())]
    assert loose == ["__main__.py"]


def test_the_listing_names_every_benchmark_under_its_group():
    listed = bench("bench")
    assert listed.returncode == 0, listed.stderr
    group, shown = "", {}
    for line in listed.stdout.splitlines()[1:]:
        if line and not line.startswith(" "):
            group = line.split(":")[0]
        elif line:
            name, summary = line.split(maxsplit=1)
            shown[name] = group
            assert "python -m" not in summary  # the summary, not the docstring's command
    assert shown == {name: b.group for name, b in catalog.benchmarks().items()}


def test_a_name_runs_its_module_and_an_unknown_one_is_refused():
    ran = bench("bench", "fleet_autoscaling", "--help")
    assert ran.returncode == 0, ran.stderr
    assert "--output" in ran.stdout and "ramp" in ran.stdout  # the module's own parser and docstring
    refused = bench("bench", "no_such_bench")
    assert refused.returncode == 2
    assert "no_such_bench" in refused.stderr and "cpu_serving" in refused.stderr
    gpu = bench("bench.gpu", "--help")  # the GPU path's own name still runs it
    assert gpu.returncode == 0 and "--dry-run" in gpu.stdout, gpu.stderr


def test_a_run_records_the_command_that_reruns_it(monkeypatch: pytest.MonkeyPatch):
    module = catalog.benchmarks()["fleet_autoscaling"].path
    monkeypatch.setattr(sys, "argv", [str(module), "--seeds", "3"])
    assert result_header("fleet_autoscaling")["command"] == "python -m bench fleet_autoscaling --seeds 3"
    monkeypatch.setattr(sys, "argv", ["pytest"])
    assert result_header("fleet_autoscaling")["command"] == "python -m bench fleet_autoscaling"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda path: path.name)
def test_a_result_file_names_a_benchmark_that_reruns_it(path: Path):
    result = json.loads(path.read_text())
    assert result["benchmark"] in catalog.benchmarks(), path.name
    command = result["command"]
    if command.startswith("python"):
        assert command.split()[:4] == ["python", "-m", "bench", result["benchmark"]], command
