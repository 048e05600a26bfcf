"""The engines' metrics as a served app exports them (Ray's metrics endpoint on this node): single
samples, the counters benchmarks and tests take before and after a run, and what a replica still
holds once the load has drained."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from common.finish_reason import FinishReason
from common.metrics_sinks import PREFIX
from replica_engine.metrics.engine_metrics import REASON_LABEL


class MetricsSource(Protocol):
    """A node's metrics export endpoint (a ServeCluster's node, or one node of a multi-node one)."""

    @property
    def metrics_url(self) -> str: ...


# RayServeSink's instruments are exported as ray_<name>.
ENGINE_PREFIX = "ray_" + PREFIX
DRAIN_TIMEOUT_S = 60  # a deadline on state: drained within a few report periods when idle
# Ray exports a process's counters about once a second (RAY_metrics_report_interval_ms in the test
# clusters): counts unchanged over three periods have every event counted before the first read.
SETTLE_S = 3.0
SETTLE_TIMEOUT_S = 300  # a deadline on state: counts settle within seconds once the requests end
# Ray's metrics agent answers 500 when a read raises: on a loaded 2-core runner OpenTelemetry's
# collection stalled 2 minutes and raised MetricsTimeoutError (dashboard_agent.err), and the next
# read was whole. A page is retried until this deadline, then the endpoint's error is raised.
PAGE_TIMEOUT_S = 300
Counts = TypeVar("Counts")


class MetricsPage:
    """One read of the metrics endpoint, so figures taken together come from the same moment."""

    def __init__(self, cluster: MetricsSource) -> None:
        text = read_page(cluster.metrics_url)
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def by_replica(self, name: str, labels: dict[str, str], per: str = "replica") -> dict[str, float]:
        """The samples called `name` whose labels include `labels`, summed per value of their `per`
        label (the replica that exports them, unless a metric names another: a router's target)."""
        values: dict[str, float] = {}
        for sample in self.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                replica = sample.labels.get(per, "")
                values[replica] = values.get(replica, 0.0) + sample.value
        return values

    def total(self, name: str, labels: dict[str, str]) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
        return sum(self.by_replica(name, labels).values())


def read_page(url: str, timeout_s: float = PAGE_TIMEOUT_S) -> str:
    """The endpoint's text once it answers 200; its last error (an answer, or none in time) once
    `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = httpx.get(url, timeout=30)
            if answer.status_code == 200 or time.monotonic() > deadline:
                answer.raise_for_status()
                return answer.text
        except httpx.TransportError:  # a stalled agent: no answer within the read's timeout
            if time.monotonic() > deadline:
                raise
        time.sleep(1)


def scrape(cluster: MetricsSource, name: str, labels: dict[str, str]) -> float:
    return MetricsPage(cluster).total(name, labels)


def scrape_by_replica(cluster: MetricsSource, name: str, labels: dict[str, str]) -> dict[str, float]:
    return MetricsPage(cluster).by_replica(name, labels)


@dataclass(frozen=True)
class EngineCounters:
    """An app's engine counters, summed over its replicas; finished requests also per replica."""

    preemptions: float
    prefix_cache_hits: float
    prefix_cache_queries: float
    finished_by_reason: dict[str, float]
    finished_by_replica: dict[str, float]
    generation_tokens: float = 0.0
    stream_messages: float = 0.0  # replica to Ingress, each with every token then ready for its request

    @classmethod
    def scrape(cls, cluster: MetricsSource, app: str) -> EngineCounters:
        page, labels = MetricsPage(cluster), {"application": app}
        finished = f"{ENGINE_PREFIX}requests_finished_total"
        return cls(
            page.total(f"{ENGINE_PREFIX}num_preemptions_total", labels),
            page.total(f"{ENGINE_PREFIX}prefix_cache_hits_total", labels),
            page.total(f"{ENGINE_PREFIX}prefix_cache_queries_total", labels),
            {r.value: page.total(finished, {**labels, REASON_LABEL: r.value}) for r in FinishReason},
            page.by_replica(finished, labels),
            page.total(f"{ENGINE_PREFIX}generation_tokens_total", labels),
            page.total(f"{ENGINE_PREFIX}stream_messages_total", labels),
        )

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached over those looked up (0 when none were)."""
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0

    def since(self, before: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.preemptions - before.preemptions,
            self.prefix_cache_hits - before.prefix_cache_hits,
            self.prefix_cache_queries - before.prefix_cache_queries,
            {r: n - before.finished_by_reason.get(r, 0.0) for r, n in self.finished_by_reason.items()},
            {r: n - before.finished_by_replica.get(r, 0.0) for r, n in self.finished_by_replica.items()},
            self.generation_tokens - before.generation_tokens,
            self.stream_messages - before.stream_messages,
        )


def replicas_reporting(cluster: MetricsSource, app: str) -> set[str]:
    """The app's EngineReplicas whose gauges this endpoint exports (what the engines themselves
    say: a replacement appears once it runs; no GCS or dashboard needed)."""
    return set(MetricsPage(cluster).by_replica(f"{ENGINE_PREFIX}num_requests_running", {"application": app}))


def held_after_drain(cluster: MetricsSource, app: str) -> dict[str, dict[str, float]]:
    """Per live replica: requests running or waiting, and KV blocks still held."""
    page, labels = MetricsPage(cluster), {"application": app}

    def gauge(name: str) -> dict[str, float]:
        return page.by_replica(f"{ENGINE_PREFIX}{name}", labels)

    running, waiting = gauge("num_requests_running"), gauge("num_requests_waiting")
    free, usage = gauge("num_free_kv_blocks"), gauge("kv_cache_usage_perc")
    held = {}
    for replica in free:
        used = round(free[replica] * usage[replica] / (1 - usage[replica])) if usage[replica] < 1 else -1
        held[replica] = {
            "running": running.get(replica, 0),
            "waiting": waiting.get(replica, 0),
            "kv_blocks_held": used,  # -1: every block
        }
    return held


def wait_drained(cluster: MetricsSource, app: str) -> tuple[float, dict[str, dict[str, float]]]:
    """Until every replica reports nothing running, waiting or held (or the timeout)."""
    started = time.monotonic()
    while True:
        held = held_after_drain(cluster, app)
        if held and all(not any(values.values()) for values in held.values()):
            return time.monotonic() - started, held
        if time.monotonic() - started > DRAIN_TIMEOUT_S:
            return math.inf, held
        time.sleep(0.5)


def settled(
    read: Callable[[], Counts], settle_s: float = SETTLE_S, timeout_s: float = SETTLE_TIMEOUT_S
) -> Counts:
    """`read()` once it stops changing for `settle_s` (three report periods: the test clusters'
    are 1 s, Ray's default 10 s): a counter read right after a request can miss it (it is
    exported later), so a test that compares counts before and after takes both settled."""
    deadline = time.monotonic() + timeout_s
    counts = read()
    while True:
        time.sleep(settle_s)
        again = read()
        if again == counts:
            return counts
        assert time.monotonic() < deadline, f"counts still changing after {timeout_s} s: {again}"
        counts = again
