"""KVPressurePolicy: Serve autoscaling on KV cache usage and queue depth, not request counts.

Each EngineReplica reports `kv_cache_usage` (0-1) and `num_waiting` through
record_autoscaling_stats; Serve averages them over its look-back window per replica, and then
applies min/max replicas and the up/down delays around what this returns."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext  # Serve passes one; the simulator calls desired_replicas

KV_USAGE = "kv_cache_usage"
WAITING = "num_waiting"


class KVPressurePolicy:
    def __init__(self, target_kv_cache_usage: float = 0.6, target_waiting_requests: float = 4) -> None:
        if not 0 < target_kv_cache_usage <= 1:
            raise ValueError(f"target_kv_cache_usage must be in (0, 1], got {target_kv_cache_usage}")
        if target_waiting_requests <= 0:
            raise ValueError(f"target_waiting_requests must be > 0, got {target_waiting_requests}")
        self.target_kv_cache_usage = target_kv_cache_usage
        self.target_waiting_requests = target_waiting_requests

    def desired_replicas(self, num_replicas: int, kv_usage: list[float], waiting: list[float]) -> int:
        """ceil(replicas x max(mean KV usage / target, mean queue / target)); no reports: no change.
        With no load at all this asks for 0, which Serve's min_replicas then bounds."""
        if num_replicas == 0 or not kv_usage:
            return num_replicas
        kv_ratio = sum(kv_usage) / len(kv_usage) / self.target_kv_cache_usage
        waiting_ratio = sum(waiting) / len(waiting) / self.target_waiting_requests if waiting else 0.0
        return math.ceil(num_replicas * max(kv_ratio, waiting_ratio) - 1e-9)

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        kv_usage = list(metrics.get(KV_USAGE, {}).values())
        waiting = list(metrics.get(WAITING, {}).values())
        return self.desired_replicas(ctx.current_num_replicas, kv_usage, waiting), {}
