"""KVPressurePolicy: Serve autoscaling on KV cache usage, queue depth and ongoing requests.

Each EngineReplica reports `kv_cache_usage` (0-1) and `num_waiting` through
record_autoscaling_stats; Serve averages them over its look-back window per replica, counts the
deployment's ongoing requests (running and queued), and then applies min/max replicas and the
up/down delays around what this returns.

KV usage alone is not enough: with prefix caching a request holds a small share of a CPU
replica's pool, which is compute-bound long before it is full. In the fleet simulator
(bench.fleet_autoscaling, a 4x ramp) a KV-and-queue policy saw usage ~0.1 at 16 replicas, asked
for 3, and Serve went 16 -> 2 in one decision; the queue then built for the 30 s new replicas
take to start (TTFT p90 82 s). So ongoing requests per replica count too, and one decision never
removes more than half the replicas."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from common.autoscaling_stats import KV_USAGE, WAITING

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext  # Serve passes one; the simulator calls desired_replicas


class KVPressurePolicy:
    def __init__(
        self,
        target_kv_cache_usage: float = 0.6,
        target_waiting_requests: float = 4,
        target_ongoing_requests: float = 4,
        max_downscale_fraction: float = 0.5,
    ) -> None:
        if not 0 < target_kv_cache_usage <= 1:
            raise ValueError(f"target_kv_cache_usage must be in (0, 1], got {target_kv_cache_usage}")
        if target_waiting_requests <= 0:
            raise ValueError(f"target_waiting_requests must be > 0, got {target_waiting_requests}")
        if target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got {target_ongoing_requests}")
        if not 0 < max_downscale_fraction <= 1:
            raise ValueError(f"max_downscale_fraction must be in (0, 1], got {max_downscale_fraction}")
        self.target_kv_cache_usage = target_kv_cache_usage
        self.target_waiting_requests = target_waiting_requests
        self.target_ongoing_requests = target_ongoing_requests
        self.max_downscale_fraction = max_downscale_fraction

    def desired_replicas(
        self, num_replicas: int, kv_usage: list[float], waiting: list[float], ongoing_requests: float = 0.0
    ) -> int:
        """ceil(replicas x max(mean KV usage / target, mean queue / target, ongoing requests per
        replica / target)), but no fewer than (1 - max_downscale_fraction) of the replicas; no
        reports: no change. `ongoing_requests`: the deployment's, running and queued."""
        if num_replicas == 0 or not kv_usage:
            return num_replicas
        kv_ratio = sum(kv_usage) / len(kv_usage) / self.target_kv_cache_usage
        waiting_ratio = sum(waiting) / len(waiting) / self.target_waiting_requests if waiting else 0.0
        ongoing_ratio = ongoing_requests / num_replicas / self.target_ongoing_requests
        desired = math.ceil(num_replicas * max(kv_ratio, waiting_ratio, ongoing_ratio) - 1e-9)
        return max(desired, math.ceil(num_replicas * (1 - self.max_downscale_fraction) - 1e-9))

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        kv_usage = list(metrics.get(KV_USAGE, {}).values())
        waiting = list(metrics.get(WAITING, {}).values())
        desired = self.desired_replicas(ctx.current_num_replicas, kv_usage, waiting, ctx.total_num_requests)
        return desired, {}
