"""Engine metrics: one recording path (EngineMetrics), two sinks (prometheus_client, Ray Serve)."""

from replica_engine.metrics.engine_metrics import EngineMetrics
from replica_engine.metrics.sinks import MetricsSink, PrometheusSink, RayServeSink

__all__ = ["EngineMetrics", "MetricsSink", "PrometheusSink", "RayServeSink"]
