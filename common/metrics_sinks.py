"""Where metrics go: `prometheus_client` (the engine on its own) or `ray.serve.metrics` (inside a
Serve replica; Ray's metrics agent exports them on each node, tagged by deployment and replica).

Both sinks make the same three kinds of instrument, each taking its label values as a dict."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

PREFIX = "stallfree_"  # of every metric of ours (Ray exports it as `ray_stallfree_...`)
Labels = dict[str, str]
# One update, as BufferedSink records it for another process to replay: (metric name, method
# of its instrument: inc / set / observe, value, labels).
MetricOp = tuple[str, str, float, Labels]


class Counter(Protocol):
    def inc(self, amount: float, labels: Labels) -> None: ...

    def initialize(self, labels: Labels) -> None:
        """Export this label set's series at 0 now, so a fresh deployment's panels show 0
        rather than no data until the first count."""


class Gauge(Protocol):
    def set(self, value: float, labels: Labels) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float, labels: Labels) -> None: ...


class MetricsSink(Protocol):
    """Counter names omit `_total`: both backends add it on export."""

    def counter(self, name: str, description: str, label_names: Sequence[str]) -> Counter: ...

    def gauge(self, name: str, description: str, label_names: Sequence[str]) -> Gauge: ...

    def histogram(
        self, name: str, description: str, buckets: Sequence[float], label_names: Sequence[str]
    ) -> Histogram: ...


class _PrometheusInstrument:
    def __init__(self, metric) -> None:
        self._metric = metric

    def inc(self, amount: float, labels: Labels) -> None:
        self._metric.labels(**labels).inc(amount)

    def initialize(self, labels: Labels) -> None:
        self._metric.labels(**labels)  # prometheus_client creates a labelled child at 0

    def set(self, value: float, labels: Labels) -> None:
        self._metric.labels(**labels).set(value)

    def observe(self, value: float, labels: Labels) -> None:
        self._metric.labels(**labels).observe(value)


class PrometheusSink:
    """prometheus_client instruments in `registry` (default: the global one, which
    `prometheus_client.start_http_server(port)` serves)."""

    def __init__(self, registry=None) -> None:
        import prometheus_client

        self._client = prometheus_client
        self._registry = registry if registry is not None else prometheus_client.REGISTRY

    def counter(self, name: str, description: str, label_names: Sequence[str]) -> Counter:
        return _PrometheusInstrument(
            self._client.Counter(name, description, label_names, registry=self._registry)
        )

    def gauge(self, name: str, description: str, label_names: Sequence[str]) -> Gauge:
        return _PrometheusInstrument(
            self._client.Gauge(name, description, label_names, registry=self._registry)
        )

    def histogram(
        self, name: str, description: str, buckets: Sequence[float], label_names: Sequence[str]
    ) -> Histogram:
        metric = self._client.Histogram(
            name, description, label_names, buckets=buckets, registry=self._registry
        )
        return _PrometheusInstrument(metric)


class _RayInstrument:
    def __init__(self, metric) -> None:
        self._metric = metric

    def inc(self, amount: float, labels: Labels) -> None:
        if amount:  # Ray refuses 0, which counts nothing anyway
            self._metric.inc(amount, tags=labels)

    def initialize(self, labels: Labels) -> None:
        # Ray's public inc() refuses 0 and no public call creates a series; _record is what inc
        # calls after its check (ray/util/metrics.py, Ray 2.60), and records 0 as any other value.
        self._metric._record(0, tags=labels)

    def set(self, value: float, labels: Labels) -> None:
        self._metric.set(value, tags=labels)

    def observe(self, value: float, labels: Labels) -> None:
        self._metric.observe(value, tags=labels)


class RayServeSink:
    """ray.serve.metrics instruments: exported as `ray_<name>` with the replica's tags added."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self._metrics = metrics

    def counter(self, name: str, description: str, label_names: Sequence[str]) -> Counter:
        return _RayInstrument(self._metrics.Counter(name, description, tag_keys=tuple(label_names)))

    def gauge(self, name: str, description: str, label_names: Sequence[str]) -> Gauge:
        return _RayInstrument(self._metrics.Gauge(name, description, tag_keys=tuple(label_names)))

    def histogram(
        self, name: str, description: str, buckets: Sequence[float], label_names: Sequence[str]
    ) -> Histogram:
        metric = self._metrics.Histogram(
            name, description, boundaries=list(buckets), tag_keys=tuple(label_names)
        )
        return _RayInstrument(metric)


class _BufferedInstrument:
    def __init__(self, name: str, ops: list[MetricOp], gauges: dict[tuple, MetricOp]) -> None:
        self._name = name
        self._ops = ops
        self._gauges = gauges  # (name, label values) -> its latest set

    def inc(self, amount: float, labels: Labels) -> None:
        self._ops.append((self._name, "inc", amount, labels))

    def initialize(self, labels: Labels) -> None:
        """Nothing to carry: the replaying side's own instruments initialized their series."""

    def set(self, value: float, labels: Labels) -> None:
        self._gauges[(self._name, *labels.values())] = (self._name, "set", value, labels)

    def observe(self, value: float, labels: Labels) -> None:
        self._ops.append((self._name, "observe", value, labels))


class BufferedSink:
    """Instruments that only record their updates, for a process that cannot reach the exporter
    (the engine core's own process): `drain` hands them over, and the frontend replays them into
    its real instruments (EngineMetrics.replay). Of a gauge's sets only the latest is carried: a
    gauge shows its latest value, and each update replayed is a metrics call there."""

    def __init__(self) -> None:
        self._ops: list[MetricOp] = []
        self._gauges: dict[tuple, MetricOp] = {}

    def drain(self) -> list[MetricOp]:
        ops = [*self._ops, *self._gauges.values()]
        self._ops.clear()
        self._gauges.clear()
        return ops

    def counter(self, name: str, description: str, label_names: Sequence[str]) -> Counter:
        return _BufferedInstrument(name, self._ops, self._gauges)

    def gauge(self, name: str, description: str, label_names: Sequence[str]) -> Gauge:
        return _BufferedInstrument(name, self._ops, self._gauges)

    def histogram(
        self, name: str, description: str, buckets: Sequence[float], label_names: Sequence[str]
    ) -> Histogram:
        return _BufferedInstrument(name, self._ops, self._gauges)
