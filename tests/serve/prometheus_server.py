"""A real Prometheus (Debian's `prometheus` package) scraping the test cluster through the
repository's dashboards/prometheus.yml as shipped. Its 5 s interval is also each scrape's timeout:
a session's cluster that has served many apps exports a long page, and a loaded 2-core host took
over 1 s to write it (a 1 s interval timed every scrape out, leaving no engine series at all)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import httpx

from common.ports import free_port
from harness.serve_cluster import REPO

READY_TIMEOUT_S = 120  # a deadline on state: Prometheus is ready in seconds on an idle machine
DASHBOARD = REPO / "dashboards" / "stallfree.json"


def start(binary: str, work_dir: Path) -> tuple[subprocess.Popen, str]:
    config_path = REPO / "dashboards" / "prometheus.yml"
    url = f"http://127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={work_dir / 'data'}",
            f"--web.listen-address={url.removeprefix('http://')}",
        ],
        stdout=(work_dir / "prometheus.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/-/ready", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise TimeoutError(
        f"prometheus was not ready in {READY_TIMEOUT_S} s: {(work_dir / 'prometheus.log').read_text()}"
    )


def query(url: str, promql: str) -> list[dict]:
    response = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=30)
    body = response.json()
    assert body["status"] == "success", f"{promql}: {body}"
    return body["data"]["result"]


def unanswered(url: str, queries: dict[str, str], timeout_s: float = 180) -> dict[str, str]:
    """The queries still returning nothing once `timeout_s` has passed (series appear as
    Prometheus scrapes them, every 5 s: a deadline on state, sized for a loaded machine)."""
    deadline, empty = time.monotonic() + timeout_s, dict(queries)
    while empty and time.monotonic() < deadline:
        empty = {key: expr for key, expr in empty.items() if not query(url, expr)}
        time.sleep(1)
    return empty


def targets(url: str) -> list[dict]:
    """What Prometheus scraped and how it went (address, health, last error, duration): the first
    thing to read when a query returns nothing."""
    active = httpx.get(f"{url}/api/v1/targets", timeout=30).json()["data"]["activeTargets"]
    keys = ("scrapeUrl", "health", "lastError", "lastScrapeDuration")
    return [{key: target.get(key) for key in keys} for target in active]


def unhealthy_rules(url: str, timeout_s: float = 120) -> dict[str, str]:
    """The loaded alert rules not yet evaluated without error once `timeout_s` has passed (every
    rule is evaluated each 5 s): name -> its health and last error. Empty when none is loaded."""
    deadline = time.monotonic() + timeout_s
    while True:
        groups = httpx.get(f"{url}/api/v1/rules", timeout=30).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        bad = {r["name"]: f"{r['health']} {r.get('lastError', '')}" for r in rules if r["health"] != "ok"}
        if not rules:
            return {"(none)": "no rule loaded"}
        if not bad or time.monotonic() > deadline:
            return bad
        time.sleep(1)


def dashboard_queries(with_optional: bool = True) -> dict[str, str]:
    """Every PromQL expression in the dashboard (panel targets, and the selectors its variables
    read labels from), with Grafana's variables replaced as Grafana would on 'All'. Without
    `with_optional`, less the panels of features a deployment may leave off."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = {
        f"{panel['title']} [{target['refId']}]": target["expr"]
        for panel in dashboard["panels"]
        for target in panel["targets"]
        if with_optional or not is_optional(panel)
    }
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            selector = re.fullmatch(r"label_values\((.*), *\w+\)", variable["definition"]).group(1)
            queries[f"variable {variable['name']}"] = selector
    substitutions = {"$__rate_interval": "1m", "$model": ".*", "$replica": ".*"}
    for key, expr in queries.items():
        for variable, value in substitutions.items():
            expr = expr.replace(variable, value)
        queries[key] = expr
    return queries


def is_optional(panel: dict) -> bool:
    """A panel of a feature off by default: it says so where Grafana would show "No data"."""
    return "noValue" in panel.get("fieldConfig", {}).get("defaults", {})
