"""Autoscaling on the simulator's clock, as Serve 2.60 runs it: every control period a policy asks
for a replica count from the replicas' metrics averaged over a look-back window; Serve's own
scaling-factor and delay code (ray.serve.autoscaling_policy, called with the virtual clock) turns
that into a decision, bounded by min and max replicas. A new replica serves after a start time;
a removed one takes no new requests and goes when its last one finishes (Serve drains it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from router.autoscaling import FleetLoad, KVPressurePolicy

POLICIES = ("kv_pressure", "ongoing_requests")  # ours (router/autoscaling.py), Serve's default


@dataclass(frozen=True)
class AutoscalingSpec:
    policy: str = "kv_pressure"
    min_replicas: int = 1
    max_replicas: int = 4
    upscale_delay_s: float = 10.0  # serve_config.yaml's example; Serve's default is 30
    downscale_delay_s: float = 60.0  # Serve's default is 600
    look_back_period_s: float = 30.0  # Serve's default
    target_ongoing_requests: float = 2.0  # per replica: Serve's default policy's (2); ours uses it too
    target_kv_cache_usage: float = 0.6  # ours
    target_waiting_requests: float = 4.0  # ours
    target_utilization: float = 0.5  # ours
    backlog_drain_s: float = 30.0  # ours
    metrics_period_s: float = 0.5  # replicas record their autoscaling metrics this often
    control_period_s: float = 0.1  # Serve's controller loop

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {POLICIES}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            bounds = f"{self.min_replicas}, {self.max_replicas}"
            raise ValueError(f"min_replicas/max_replicas: need 1 <= min <= max, got {bounds}")

    def serve_config(self) -> Any:
        """Serve's own AutoscalingConfig with these settings (its delay code reads it)."""
        from ray.serve.config import AutoscalingConfig  # Ray only when autoscaling is simulated

        return AutoscalingConfig(
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            upscale_delay_s=self.upscale_delay_s,
            downscale_delay_s=self.downscale_delay_s,
            look_back_period_s=self.look_back_period_s,
            target_ongoing_requests=self.target_ongoing_requests,
        )


@dataclass(frozen=True)
class ReplicaSample:
    """One replica's autoscaling metrics at one moment."""

    ongoing_requests: float
    kv_cache_usage: float
    num_waiting: float
    rates: dict[str, float]  # LoadMeter's since the replica's previous sample (none on its first)


class Autoscaler:
    """Serve's controller, for one deployment: samples in, a target replica count out."""

    def __init__(self, spec: AutoscalingSpec) -> None:
        from ray.serve import autoscaling_policy  # Serve's delay and scaling-factor functions

        self.spec = spec
        self._serve = autoscaling_policy
        self._config = spec.serve_config()
        self._policy = KVPressurePolicy(
            spec.target_kv_cache_usage,
            spec.target_waiting_requests,
            spec.target_ongoing_requests,
            target_utilization=spec.target_utilization,
            backlog_drain_s=spec.backlog_drain_s,
        )
        self._state: dict[str, Any] = {}
        self._samples: dict[str, deque[tuple[float, ReplicaSample]]] = {}
        self._queued: deque[tuple[float, int]] = deque()  # requests waiting at the router

    def record(self, now: float, samples: dict[str, ReplicaSample], num_queued: int) -> None:
        """The running replicas' metrics now (a replica not listed is gone)."""
        horizon = now - self.spec.look_back_period_s
        self._samples = {replica: self._samples.get(replica, deque()) for replica in samples}
        for replica, sample in samples.items():
            window = self._samples[replica]
            window.append((now, sample))
            while window[0][0] < horizon:
                window.popleft()
        self._queued.append((now, num_queued))
        while self._queued[0][0] < horizon:
            self._queued.popleft()

    def decide(self, now: float, num_running: int, target: int) -> int:
        """The new target replica count (`target`: the current one, starting replicas included)."""
        means = [_mean(window) for window in self._samples.values() if window]
        queued = sum(n for _, n in self._queued) / len(self._queued) if self._queued else 0.0
        if num_running == 0:
            return max(target, self.spec.min_replicas, 1 if queued > 0 else 0)
        total = sum(m.ongoing_requests for m in means) + queued  # Serve's total_num_requests
        if self.spec.policy == "kv_pressure":
            kv_usage, waiting = [m.kv_cache_usage for m in means], [m.num_waiting for m in means]
            load = FleetLoad.of(lambda name: sum(m.rates.get(name, 0.0) for m in means))
            desired: float = self._policy.desired_replicas(
                num_running, kv_usage, waiting, total, load, queued
            )
        else:  # Serve's default: total ongoing (and queued) requests over target_ongoing_requests
            desired = total / self.spec.target_ongoing_requests
        scaled = self._serve._apply_scaling_factors(desired, num_running, self._config)
        decided, self._state = self._serve._apply_delay_logic(
            max(0, scaled), target, self._config, self._state, _now=now
        )
        return min(self.spec.max_replicas, max(self.spec.min_replicas, decided))


def _mean(window: Sequence[tuple[float, ReplicaSample]]) -> ReplicaSample:
    """As Serve averages each metric over the window: rates over the samples that have them."""
    n = len(window)
    rated = [s.rates for _, s in window if s.rates]
    return ReplicaSample(
        ongoing_requests=sum(s.ongoing_requests for _, s in window) / n,
        kv_cache_usage=sum(s.kv_cache_usage for _, s in window) / n,
        num_waiting=sum(s.num_waiting for _, s in window) / n,
        rates={name: sum(r[name] for r in rated) / len(rated) for name in rated[0]} if rated else {},
    )
