"""Engine metrics: one recording path (EngineMetrics), two sinks (prometheus_client, Ray Serve)."""

from common.metrics_sinks import MetricsSink, PrometheusSink, RayServeSink
from replica_engine.metrics.engine_metrics import EngineMetrics

__all__ = ["EngineMetrics", "MetricsSink", "PrometheusSink", "RayServeSink"]
