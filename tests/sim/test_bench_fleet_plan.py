"""bench.fleet.fleet's plan entries (PROFILE:WORKLOADS:SIZES[:ROUTERS]) and its plot of a run that left
routers out."""

import re

import pytest

from bench.fleet.fleet import _plan_entry, judge, plot
from fleet_sim.routers import ROUTERS


def test_an_entry_without_routers_runs_every_router():
    assert _plan_entry("cpu:a,b:4,16") == ("cpu", "a,b", "4,16", list(ROUTERS))


def test_an_entry_names_the_routers_it_runs():
    entry = "h100-llama3-8b:a:4:kv_prefix,prefix_cache_affinity"
    assert _plan_entry(entry) == ("h100-llama3-8b", "a", "4", ["kv_prefix", "prefix_cache_affinity"])


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("cpu:a:4:kv_prefix,nope", "['nope']"),
        ("cpu:a", "PROFILE:WORKLOADS:SIZES"),
        ("cpu:a:4:x:y", "PROFILE:WORKLOADS:SIZES"),
    ],
)
def test_a_bad_entry_is_refused_naming_what_is_wrong(entry: str, says: str):
    with pytest.raises(SystemExit, match=f"{re.escape(f'--run {entry}: ')}.*{re.escape(says)}"):
        _plan_entry(entry)


def _runs(ttft_p90_s: float) -> list[dict]:
    return [{"ttft_p90_s": ttft_p90_s, "hit_rate": 0.5, "output_tok_per_s": 100.0} for _ in range(3)]


def test_a_run_with_some_routers_is_judged_and_plotted(tmp_path):
    results = {"h100-llama3-8b": {"a": {"4": {"kv_prefix": _runs(1.0), "prefix_cache_affinity": _runs(2.0)}}}}
    body: dict = {}
    met = judge(results, body)
    assert met == {
        "h100-llama3-8b (a) 4: TTFT p90 / prefix_cache_affinity's <= 1.0x": True,
        "h100-llama3-8b (a) 4: tok/s / prefix_cache_affinity's >= 1.0x": True,
    }
    plot(tmp_path / "fleet.png", results)
    assert (tmp_path / "fleet.png").stat().st_size > 0
