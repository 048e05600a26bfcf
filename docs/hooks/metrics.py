"""The metrics table, generated from the code that declares the metrics: each declaring object is
built on a recording sink, which keeps every counter, gauge and histogram it is asked for (name,
description, labels, buckets). SOURCES names every module that declares metrics; the docs test
fails when another module calls `sink.counter/gauge/histogram` without being listed here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("counter", "gauge", "histogram")


class MissingDescription(ValueError):
    """A metric was declared without a description."""


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    description: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()
    source: str = ""

    @property
    def exported(self) -> str:
        """The name a scrape shows (both sinks add `_total` to counters; Ray adds `ray_` too)."""
        return self.name + "_total" if self.kind == "counter" else self.name


class _Instrument:
    def inc(self, amount: float, labels: dict[str, str]) -> None: ...

    def initialize(self, labels: dict[str, str]) -> None: ...

    def set(self, value: float, labels: dict[str, str]) -> None: ...

    def observe(self, value: float, labels: dict[str, str]) -> None: ...


class RecordingSink:
    """A MetricsSink (common/metrics_sinks.py) that records what is declared on it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.metrics: list[Metric] = []

    def _add(self, name: str, kind: str, description: str, labels: Sequence[str], buckets=()) -> _Instrument:
        metric = Metric(name, kind, description, tuple(labels), tuple(buckets), self.source)
        self.metrics.append(metric)
        return _Instrument()

    def counter(self, name: str, description: str, label_names: Sequence[str]) -> _Instrument:
        return self._add(name, "counter", description, label_names)

    def gauge(self, name: str, description: str, label_names: Sequence[str]) -> _Instrument:
        return self._add(name, "gauge", description, label_names)

    def histogram(
        self, name: str, description: str, buckets: Sequence[float], label_names: Sequence[str]
    ) -> _Instrument:
        return self._add(name, "histogram", description, label_names, buckets)


def _engine(sink: RecordingSink) -> None:
    from replica_engine.metrics.engine_metrics import EngineMetrics

    EngineMetrics(sink, model_name="model")  # type: ignore[arg-type]


def _http(sink: RecordingSink) -> None:
    from deployments.http_metrics import HttpMetrics

    HttpMetrics(sink)  # type: ignore[arg-type]


def _router(cls_path: str) -> Callable[[RecordingSink], None]:
    def declare(sink: RecordingSink) -> None:
        import importlib

        module, name = cls_path.rsplit(".", 1)
        cls: Any = getattr(importlib.import_module(module), name)
        # initialize_state is where a RequestRouter declares its state; Serve's __init__ (which
        # needs a running deployment) is not what declares metrics.
        cls.__new__(cls).initialize_state(sink=sink)

    return declare


# Module (as a path from the repository root) -> how to make it declare its metrics.
SOURCES: dict[str, Callable[[RecordingSink], None]] = {
    "replica_engine/metrics/engine_metrics.py": _engine,
    "deployments/http_metrics.py": _http,
    "router/kv_router.py": _router("router.kv_router.KVPressureRouter"),
    "router/prefix_router.py": _router("router.prefix_router.KVPrefixRouter"),
}


def collect() -> list[Metric]:
    """Every declared metric once (a subclass redeclaring its parent's is kept at the parent)."""
    seen: dict[str, Metric] = {}
    for source, declare in SOURCES.items():
        sink = RecordingSink(source)
        declare(sink)
        for metric in sink.metrics:
            if not metric.description.strip():
                raise MissingDescription(f"metric {metric.name} ({source}) has no description")
            seen.setdefault(metric.name, metric)
    return list(seen.values())


def _buckets(buckets: tuple[float, ...]) -> str:
    return ", ".join(f"{b:g}" for b in buckets)


def render() -> str:
    lines = ["| metric | type | labels | meaning | declared in |", "|---|---|---|---|---|"]
    for metric in collect():
        labels = ", ".join(f"`{label}`" for label in metric.labels)
        meaning = metric.description
        if metric.buckets:
            meaning += f" (buckets: {_buckets(metric.buckets)})"
        source = f"`{metric.source}`"
        meaning = meaning.replace("|", "\\|")
        lines.append(f"| `{metric.exported}` | {metric.kind} | {labels} | {meaning} | {source} |")
    return "\n".join(lines)
