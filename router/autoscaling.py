"""KVPressurePolicy: Serve autoscaling on KV cache usage and the load the arrivals bring.

Each EngineReplica reports through record_autoscaling_stats its `kv_cache_usage` (0-1), its
queue (`num_waiting`) and three rates: requests added and finished per second, and the seconds of
step work per second (step time beyond the fastest step's: the fixed cost of a step, reading the
weights on a GPU, is not load). Serve averages them over its look-back window per replica, and
then applies min/max replicas and the up/down delays around what this returns.

The replicas needed are the work the arrivals bring, plus draining the queues within
`backlog_drain_s`, at `target_utilization` of each replica's time: (arrivals/s + queued /
backlog_drain_s) x work per finished request / target_utilization. Sizing for the arrival rate,
not for the backlog, matters when replicas take long to start: a queue that builds while they
start asked a policy on queue depth or ongoing requests (Serve's default) for far more replicas
than the load needed, held until the downscale delay passed (bench.fleet.fleet_autoscaling). KV usage
still counts (a replica whose pool is full cannot take more), and before any request has
finished, queue depth and ongoing requests per replica stand in for the rates.

One decision never removes more than half the replicas."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.autoscaling_stats import ARRIVALS, FINISHED, KV_USAGE, WAITING, WORK

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext  # Serve passes one; the simulator calls desired_replicas


@dataclass(frozen=True)
class FleetLoad:
    """The replicas' rates, summed over them (each averaged over the look-back window)."""

    arrivals_per_s: float
    finished_per_s: float
    work_fraction: float  # replicas' worth of step work

    @classmethod
    def of(cls, total: Callable[[str], float]) -> FleetLoad:
        """From `total(name)`: a rate (common.autoscaling_stats) summed over the replicas."""
        return cls(total(ARRIVALS), total(FINISHED), total(WORK))


class KVPressurePolicy:
    def __init__(
        self,
        target_kv_cache_usage: float = 0.6,
        target_waiting_requests: float = 4,
        target_ongoing_requests: float = 4,
        max_downscale_fraction: float = 0.5,
        target_utilization: float = 0.5,
        backlog_drain_s: float = 30.0,
    ) -> None:
        if not 0 < target_kv_cache_usage <= 1:
            raise ValueError(f"target_kv_cache_usage must be in (0, 1], got {target_kv_cache_usage}")
        if target_waiting_requests <= 0:
            raise ValueError(f"target_waiting_requests must be > 0, got {target_waiting_requests}")
        if target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got {target_ongoing_requests}")
        if not 0 < max_downscale_fraction <= 1:
            raise ValueError(f"max_downscale_fraction must be in (0, 1], got {max_downscale_fraction}")
        if not 0 < target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {target_utilization}")
        if backlog_drain_s <= 0:
            raise ValueError(f"backlog_drain_s must be > 0, got {backlog_drain_s}")
        self.target_kv_cache_usage = target_kv_cache_usage
        self.target_waiting_requests = target_waiting_requests
        self.target_ongoing_requests = target_ongoing_requests
        self.max_downscale_fraction = max_downscale_fraction
        self.target_utilization = target_utilization
        self.backlog_drain_s = backlog_drain_s

    def desired_replicas(
        self,
        num_replicas: int,
        kv_usage: list[float],
        waiting: list[float],
        ongoing_requests: float = 0.0,
        load: FleetLoad | None = None,
        queued_requests: float = 0.0,
    ) -> int:
        """ceil(max(replicas x mean KV usage / target, replicas the load needs)), but no fewer than
        (1 - max_downscale_fraction) of the replicas; no reports: no change. `ongoing_requests`:
        the deployment's, running and queued; `queued_requests`: those waiting for a replica at the
        routers. With no rates yet (`load` None or nothing finished), queue depth and ongoing
        requests per replica over their targets measure the load."""
        if num_replicas == 0 or not kv_usage:
            return num_replicas
        kv_ratio = sum(kv_usage) / len(kv_usage) / self.target_kv_cache_usage
        if load is not None and load.finished_per_s > 0:
            work_per_request = load.work_fraction / load.finished_per_s
            demand = load.arrivals_per_s + (sum(waiting) + queued_requests) / self.backlog_drain_s
            load_ratio = demand * work_per_request / self.target_utilization / num_replicas
        else:
            waiting_ratio = sum(waiting) / len(waiting) / self.target_waiting_requests if waiting else 0.0
            load_ratio = max(waiting_ratio, ongoing_requests / num_replicas / self.target_ongoing_requests)
        desired = math.ceil(num_replicas * max(kv_ratio, load_ratio) - 1e-9)
        return max(desired, math.ceil(num_replicas * (1 - self.max_downscale_fraction) - 1e-9))

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        kv_usage = list(metrics.get(KV_USAGE, {}).values())
        waiting = list(metrics.get(WAITING, {}).values())
        load = FleetLoad.of(lambda name: sum(metrics.get(name, {}).values()))
        queued = ctx.total_queued_requests or 0.0
        desired = self.desired_replicas(
            ctx.current_num_replicas, kv_usage, waiting, ctx.total_num_requests, load, queued
        )
        return desired, {}
