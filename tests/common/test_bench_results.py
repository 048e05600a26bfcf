"""Result files stay what a person can read and git can carry: summaries under a size bound, each
judged by its goals; per-request records go beside them, gzipped (bench.driver.write_raw)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench.driver import raw_path, write_result

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
MAX_BYTES = 200_000  # the largest summary-only file (fleet.json, 252 runs' summaries) is 172 KB


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda path: path.name)
def test_a_result_file_is_a_summary_judged_by_its_goals(path: Path):
    size = path.stat().st_size
    assert size <= MAX_BYTES, f"{path.name}: {size} bytes; per-request records go to {raw_path(path).name}"
    result = json.loads(path.read_text())
    assert {"goals", "goals_met"} <= result.keys(), f"{path.name} does not say what it was judged by"


def test_every_side_file_belongs_to_a_result():
    results = {raw_path(path) for path in RESULTS.glob("*.json")}
    assert not [side.name for side in RESULTS.glob("*.raw.json.gz") if side not in results]


def test_write_result_puts_requests_beside_the_summary(tmp_path: Path):
    path = tmp_path / "bench.json"
    raw = {"ours": [{"ttft_s": 0.12345678, "token_intervals_s": [0.0200000049, 0.03]}]}
    summary = {"ttft_p50_s": 0.123456789, "coefficients": (1.23456789e-08, 2.0), "requests": 730}
    write_result(path, {"summary": summary, "goals": {}, "goals_met": {}, "run_s": 1.0}, raw)
    written = json.loads(path.read_text())
    assert "ours" not in written
    # figures to 7 significant digits, however small
    assert written["summary"] == {
        "ttft_p50_s": 0.1234568,
        "coefficients": [1.234568e-08, 2.0],
        "requests": 730,
    }
    with gzip.open(raw_path(path), "rt") as file:
        assert json.load(file) == {"ours": [{"ttft_s": 0.123457, "token_intervals_s": [0.02, 0.03]}]}
    first = raw_path(path).read_bytes()
    write_result(path, {"goals": {}, "goals_met": {}, "run_s": 2.0}, raw)
    assert raw_path(path).read_bytes() == first  # a rerun with the same records changes nothing in git


def test_no_goal_is_met_against_a_peer_quoted_from_another_run():
    """A peer not installed on the day is quoted from another run (maybe another CPU): a goal
    against it is unmet, not judged, however its quoted figures compare; a goal against every
    peer is met only when every peer was measured."""
    from bench.serving.cpu_serving_report import goals_met

    overhead = {"per_token_s": 0.0005, "per_request_s": 0.01}
    ahead = {"c1_ttft_p50_s": 0.5, "c16_ttft_p50_s": 0.5, "c16_output_tok_per_s": 2.0}
    ratios = {"vLLM CPU": ahead, "llama.cpp Q4_1": ahead}
    quoted = {"Ray Serve LLM", "llama.cpp F32"}
    met = goals_met(ratios, overhead, 0.95, quoted)
    assert met["ahead of Ray Serve LLM on every figure"] is False
    assert met["c=1 TTFT p50 <= 0.8x every peer's"] is False  # every measured peer passes; two did not run
    assert met["c=16 output tok/s >= 1.5x llama.cpp Q4_1's"] is True
    assert goals_met(ratios, overhead, 0.95, set())["c=1 TTFT p50 <= 0.8x every peer's"] is True
    behind = {**ratios, "vLLM CPU": {**ahead, "c1_ttft_p50_s": 1.2}}
    assert goals_met(behind, overhead, 0.95, set())["c=1 TTFT p50 <= 0.8x every peer's"] is False
