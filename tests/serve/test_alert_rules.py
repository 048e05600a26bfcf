"""The alert rules shipped in dashboards/alerts.yml: valid for Prometheus (`promtool check rules`),
and each fires on the series that should set it off, with the labels and text an on-call reads
(`promtool test rules`: Prometheus's own rule engine over tests/serve/alert_rules_test.yml).
test_observability.py loads them into the real Prometheus scraping the test cluster."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.debian_package import find_or_install
from harness.serve_cluster import REPO

RULES = REPO / "dashboards" / "alerts.yml"
RULE_TESTS = Path(__file__).with_name("alert_rules_test.yml")


@pytest.fixture(scope="module")
def promtool() -> str:
    binary, why_not = find_or_install("promtool", "prometheus")
    if binary is None:
        pytest.skip(why_not)
    return binary


def run(promtool: str, *args: str) -> str:
    result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_rules_are_valid(promtool: str):
    assert "SUCCESS: 6 rules found" in run(promtool, "check", "rules", str(RULES))


def test_each_rule_fires_on_what_should_set_it_off(promtool: str):
    assert "SUCCESS" in run(promtool, "test", "rules", str(RULE_TESTS))
