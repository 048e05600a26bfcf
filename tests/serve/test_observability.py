"""Metrics end to end: the replicas' metrics on Ray's export endpoint add up, the API counts its
answers by route and status, every query in the Grafana dashboard returns data from a real
Prometheus scraping the cluster, and that Prometheus evaluates the shipped alert rules."""

from __future__ import annotations

import json

import httpx
import pytest

from harness.metrics_scrape import MetricsPage, scrape_by_replica, settled
from harness.replicas import engine_deployment, engine_stats
from harness.serve_cluster import REPORT_WAIT_S, ServeCluster, post_concurrently, wait_for
from tests.engine.engine_idle import wait_idle
from tests.serve import prometheus_server

SETTLED_S = 5.0  # five metrics report periods without a change: nothing sent earlier is on its way


COUNTED = {
    "ttft": "ray_stallfree_time_to_first_token_seconds_count",
    "tbt": "ray_stallfree_inter_token_latency_seconds_count",
    "e2e": "ray_stallfree_e2e_request_latency_seconds_count",
    "generated": "ray_stallfree_generation_tokens_total",
    "messages": "ray_stallfree_stream_messages_total",
}


@pytest.fixture(scope="module")
def main_app(serve_cluster: ServeCluster) -> dict[str, str]:
    """The labels of the shipped app's engine replicas (its Ingress's, colocated)."""
    return {"application": serve_cluster.app_name, "deployment": engine_deployment(serve_cluster.app_name)}


def test_replica_metrics_add_up_on_the_ray_endpoint(serve_cluster: ServeCluster, main_app: dict[str, str]):
    def counts() -> dict[str, float]:
        page = MetricsPage(serve_cluster)  # one read: a page is parsed in a second on a loaded host
        return {key: page.total(name, main_app) for key, name in COUNTED.items()}

    # Whatever earlier tests sent has ended (the replica is idle) and been reported (the counters
    # stood still for several report periods) before the baseline is taken.
    wait_idle(lambda: engine_stats(serve_cluster.app_name))
    before = settled(counts, SETTLED_S, REPORT_WAIT_S)
    num_requests, max_tokens = 3, 5
    body = {"prompt": "Name three colours.", "max_tokens": max_tokens, "ignore_eos": True}
    assert all(
        r.status_code == 200 for r in post_concurrently(f"{serve_cluster.base_url}/v1/completions", body, 3)
    )

    expected = {
        "ttft": num_requests,
        "tbt": num_requests * (max_tokens - 1),
        "e2e": num_requests,
        "generated": num_requests * max_tokens,
    }
    wait_for(lambda: counts()["e2e"] - before["e2e"] >= num_requests, "the requests are reported")
    after = settled(counts, SETTLED_S, REPORT_WAIT_S)
    counted = {key: after[key] - before[key] for key in COUNTED}
    # A message carries every token ready for its request: at least one a request, at most one a token.
    assert num_requests <= counted.pop("messages") <= num_requests * max_tokens
    assert counted == expected
    page = MetricsPage(serve_cluster)
    assert page.total("ray_stallfree_kv_cache_usage_perc", main_app) == 0
    assert page.total("ray_stallfree_num_requests_running", main_app) == 0
    assert page.total("ray_stallfree_num_free_kv_blocks", main_app) > 0
    finished = {**main_app, "finished_reason": "length"}
    assert page.total("ray_stallfree_requests_finished_total", finished) >= num_requests


def test_the_api_counts_its_answers_by_route_and_status(serve_cluster: ServeCluster):
    app = {"application": serve_cluster.app_name}
    outcomes = {  # (route, status): what is sent for it
        ("/v1/completions", "200"): {"prompt": "Hi", "max_tokens": 2},
        ("/v1/completions", "400"): {"prompt": "Hi", "max_tokens": -1},
    }

    def counts() -> dict[tuple[str, str], float]:
        page = MetricsPage(serve_cluster)

        def count(route: str, status: str) -> float:
            labels = {**app, "route": route, "status": status}
            return page.total("ray_stallfree_http_requests_total", labels)

        return {key: count(*key) for key in [*outcomes, ("unmatched", "404")]}

    before = settled(counts, SETTLED_S, REPORT_WAIT_S)
    for (route, status), body in outcomes.items():
        response = httpx.post(f"{serve_cluster.base_url}{route}", json=body, timeout=300)
        assert response.status_code == int(status), response.text
    assert httpx.get(f"{serve_cluster.base_url}/v1/no-such-route", timeout=300).status_code == 404
    wait_for(lambda: counts() != before, "the answers are reported")
    after = settled(counts, SETTLED_S, REPORT_WAIT_S)
    assert {key: after[key] - before[key] for key in after} == dict.fromkeys(after, 1)


def test_counters_the_dashboard_reads_are_exported_before_anything_is_counted(
    serve_cluster: ServeCluster, main_app: dict[str, str]
):
    # No request of the main app ends in error, and none may be preempted: those series must
    # still exist (at 0), or a fresh deployment's panels say "No data" instead of 0.
    def exported(name: str, labels: dict[str, str]) -> bool:
        return bool(scrape_by_replica(serve_cluster, name, {**main_app, **labels}))

    for reason in ("stop", "length", "abort", "error"):
        wait_for(
            lambda reason=reason: exported(
                "ray_stallfree_requests_finished_total", {"finished_reason": reason}
            ),
            f"requests_finished_total{{finished_reason={reason}}} is exported",
        )
    wait_for(lambda: exported("ray_stallfree_num_preemptions_total", {}), "num_preemptions_total is exported")


PREEMPTING = {"prompt": "Count to ten.", "max_tokens": 50, "n": 4, "ignore_eos": True}


def test_every_dashboard_query_returns_data(serve_cluster: ServeCluster, small_app: str, prometheus: str):
    # Traffic of every kind the panels show: finished requests on both apps, and preemptions.
    httpx.post(f"{small_app}/v1/completions", json=PREEMPTING, timeout=300)
    body = {"prompt": "Count to ten.", "max_tokens": 8, "ignore_eos": True}
    post_concurrently(f"{serve_cluster.base_url}/v1/completions", body, 2)
    queries = prometheus_server.dashboard_queries()
    assert len(queries) >= 16
    empty = prometheus_server.unanswered(prometheus, queries)
    scraped = prometheus_server.targets(prometheus)
    assert not empty, (
        f"dashboard queries that return nothing: {json.dumps(empty, indent=1)}\n"
        f"Prometheus's targets: {json.dumps(scraped, indent=1)}"
    )
    assert prometheus_server.unhealthy_rules(prometheus) == {}  # dashboards/alerts.yml, loaded
