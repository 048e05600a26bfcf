"""A fleet of simulated replicas behind one router, as Serve runs them: each request goes to
the first replica in the router's ranking below max_ongoing_requests, or waits at the router,
in arrival order, until one is; replicas report their routing stats every period; with
autoscaling, Serve's controller adds replicas (serving after a start time) and drains them."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from common.autoscaling_stats import LoadMeter
from fleet_sim.autoscaling import Autoscaler, AutoscalingSpec, ReplicaSample
from fleet_sim.clock import EventLoop
from fleet_sim.pool import RouterQueue
from fleet_sim.records import RequestRecord
from fleet_sim.replica import ReplicaConfig, SimReplica, engine_request
from fleet_sim.routers import SimRouter
from fleet_sim.trace import SimRequest
from replica_engine.outputs import CoreOutput
from replica_engine.scheduler.step_time_model import StepTime


@dataclass(frozen=True)
class FleetConfig:
    num_replicas: int  # at the start (with autoscaling: Serve's initial_replicas)
    replica: ReplicaConfig
    max_ongoing_requests: int = 128  # per replica, as in serve_config.yaml
    report_period_s: float = 0.5  # Serve's request_routing_stats_period_s, as deployments/app.py sets it
    report_delay_s: float = 0.0  # from a replica's report to the routers
    replica_start_s: float = 30.0  # from Serve's decision to start one to its taking requests (model load)
    autoscaling: AutoscalingSpec | None = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas: must be >= 1, got {self.num_replicas}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests: must be >= 1, got {self.max_ongoing_requests}")
        if self.report_period_s <= 0 or self.report_delay_s < 0 or self.replica_start_s < 0:
            raise ValueError("report_period_s must be > 0, report_delay_s and replica_start_s >= 0")


class Fleet:
    def __init__(self, config: FleetConfig, step_time: StepTime, router: SimRouter) -> None:
        self.config = config
        self.step_time = step_time
        self.router = router
        self.loop = EventLoop()
        self.replicas: list[SimReplica] = []  # taking requests, oldest first
        self.records: dict[str, RequestRecord] = {}
        self.timeline: list[tuple[float, int]] = []  # (time, replicas taking requests) at each change
        self.replica_seconds = 0.0  # of every replica from its start decision until it is gone
        self.every_replica: list[SimReplica] = []  # ever created, gone ones too
        self._starting: list[SimReplica] = []  # decided, not yet taking requests
        self._draining: list[SimReplica] = []
        self._born: dict[str, float] = {}
        self._at_router = RouterQueue(router, self.replicas, config.max_ongoing_requests, self.loop)
        self._num_unfinished = 0
        self._num_created = 0
        for _ in range(config.num_replicas):
            self._serve(self._new_replica())
        spec = config.autoscaling
        self.autoscaler = Autoscaler(spec) if spec is not None else None
        self._load_meters: dict[str, LoadMeter] = {}

    def run(self, requests: Sequence[SimRequest]) -> list[RequestRecord]:
        """Serve every request; their records, in the order given, then the conversations'
        later turns in the order they were sent."""
        for request in requests:
            self._add(request)
        if self.autoscaler is not None:
            self.loop.call_at(self.loop.now, self._record_metrics)
            self.loop.call_at(self.loop.now, self._control)
        self.loop.run()
        end = max((t for record in self.records.values() for t in record.token_times[-1:]), default=0.0)
        for replica in self.replicas + self._starting:
            self._retire(replica, end)
        return list(self.records.values())

    def _add(self, request: SimRequest) -> None:
        if request.request_id in self.records:
            raise ValueError(f"request_id: {request.request_id!r} appears twice")
        self.records[request.request_id] = RequestRecord(request)
        self._num_unfinished += 1
        self.loop.call_at(request.arrival_s, functools.partial(self._arrive, request))

    # -- requests -------------------------------------------------------------------------
    def _arrive(self, request: SimRequest) -> None:
        self._at_router.push(request, functools.partial(self._start, request))

    def _start(self, request: SimRequest, replica: SimReplica) -> None:
        record = self.records[request.request_id]
        record.replica_id, record.routed_s = replica.replica_id, self.loop.now
        replica.submit(engine_request(request))

    def _dispatch(self) -> None:
        self._at_router.dispatch()

    def _on_token(self, replica: SimReplica, output: CoreOutput, now: float) -> None:
        record = self.records[output.request_id]
        if not record.take(output, now):
            return
        follow_up = record.request.follow_up(now)
        if follow_up is not None:
            self._add(follow_up)
        self._num_unfinished -= 1
        self.router.on_finished(record.request, now)
        if replica in self._draining and replica.num_ongoing == 0:
            self._draining.remove(replica)
            self._retire(replica)
        self._dispatch()

    def _report(self, replica: SimReplica) -> None:
        config = self.config
        self._at_router.report_every(
            replica, config.report_period_s, config.report_delay_s, lambda: self._num_unfinished > 0
        )

    # -- replicas -------------------------------------------------------------------------
    def fail_replica_at(self, at_s: float, replica_id: str) -> None:
        """The replica dies at `at_s` (its cache and requests lost: they fail, as Serve fails a
        dead replica's streams); Serve starts a replacement, serving after replica_start_s."""
        self.loop.call_at(at_s, functools.partial(self._fail, replica_id))

    def _fail(self, replica_id: str) -> None:
        replica = next((r for r in self.replicas if r.replica_id == replica_id), None)
        if replica is None:
            raise ValueError(f"replica_id: {replica_id!r} is not serving at {self.loop.now:.3f} s")
        self.replicas.remove(replica)
        self.timeline.append((self.loop.now, len(self.replicas)))
        self.router.keep_only(r.replica_id for r in self.replicas)
        for request_id in replica.kill():
            record = self.records[request_id]
            record.failed = True
            self._num_unfinished -= 1
            self.router.on_finished(record.request, self.loop.now)
        self._retire(replica)
        self._start_replica()
        self._dispatch()

    def _new_replica(self) -> SimReplica:
        replica_id = f"replica-{self._num_created}"
        self._num_created += 1
        self._born[replica_id] = self.loop.now
        replica = SimReplica(replica_id, self.config.replica, self.step_time, self.loop, self._on_token)
        self.every_replica.append(replica)
        return replica

    def adapter_loads(self) -> dict[str, dict[str, int]]:
        """LoRA adapter name -> replica id -> times that replica loaded it from disk."""
        loads: dict[str, dict[str, int]] = {}
        for replica in self.every_replica:
            for name, count in replica.executor.adapters.loads.items():
                loads.setdefault(name, {})[replica.replica_id] = count
        return loads

    def _serve(self, replica: SimReplica) -> None:
        """The replica takes requests; it reports out of step with the others."""
        self.replicas.append(replica)
        self.timeline.append((self.loop.now, len(self.replicas)))
        offset = self.config.report_period_s * (self._num_created % 8) / 8
        self.loop.call_later(offset, functools.partial(self._report, replica))
        self._dispatch()

    def _retire(self, replica: SimReplica, at: float | None = None) -> None:
        born = self._born.pop(replica.replica_id)
        self.replica_seconds += max(0.0, (self.loop.now if at is None else at) - born)

    def _record_metrics(self) -> None:
        assert self.autoscaler is not None
        if not self._num_unfinished:
            return
        now = self.loop.now
        samples = {replica.replica_id: self._sample(replica, now) for replica in self.replicas}
        self.autoscaler.record(now, samples, len(self._at_router))
        self.loop.call_later(self.autoscaler.spec.metrics_period_s, self._record_metrics)

    def _sample(self, replica: SimReplica, now: float) -> ReplicaSample:
        """What the replica's record_autoscaling_stats would report now."""
        stats = replica.stats()
        meter = self._load_meters.setdefault(replica.replica_id, LoadMeter())
        rates = meter.rates(now, stats.num_requests_added, stats.num_requests_finished, stats.step_work_s)
        return ReplicaSample(replica.num_ongoing, stats.kv_cache_usage, stats.num_waiting, rates)

    def _control(self) -> None:
        """Serve's controller: every control period, a target replica count from the metrics."""
        assert self.autoscaler is not None
        if not self._num_unfinished:
            return
        spec, now = self.autoscaler.spec, self.loop.now
        target = len(self.replicas) + len(self._starting)
        decided = self.autoscaler.decide(now, len(self.replicas), target)
        for _ in range(decided - target):
            self._start_replica()
        for _ in range(target - decided):
            self._stop_newest()
        self.loop.call_later(spec.control_period_s, self._control)

    def _start_replica(self) -> None:
        replica = self._new_replica()
        self._starting.append(replica)
        self.loop.call_later(self.config.replica_start_s, functools.partial(self._started, replica))

    def _started(self, replica: SimReplica) -> None:
        if replica in self._starting:  # not cancelled while it started
            self._starting.remove(replica)
            self._serve(replica)

    def _stop_newest(self) -> None:
        """Serve stops a starting replica first, else the newest running one (it drains)."""
        if self._starting:
            replica = self._starting.pop()
            self._retire(replica)
            return
        replica = self.replicas.pop()
        self.timeline.append((self.loop.now, len(self.replicas)))
        self.router.keep_only(r.replica_id for r in self.replicas)
        if replica.num_ongoing:
            self._draining.append(replica)
        else:
            self._retire(replica)
