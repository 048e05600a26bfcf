"""A prefill/decode fleet on the simulator, as deployments/disaggregated_engine.py serves one: a
request goes to a prefill replica (ranked by its router: kv_prefix by default), which computes its
prompt and exports its full blocks (the engine's own export, EngineCore over a SimExecutor); the
blocks cross the prefill replica's link to a decode replica (kv_pressure by default), which adopts
them into its prefix cache, computes the rest of the prompt, and decodes. The first token, and so
the TTFT, is the decode replica's.

A transfer takes `link.latency_s` + its bytes / `link.bytes_per_s`, one at a time per prefill
replica (its link is a queue), then `hop_s`: the Ingress's second call, to the decode deployment.
The decode replica's own work on adopted blocks (a copy into its pool) is not modelled: a GPU's
NIXL writes them in place. Fixed replica counts (no autoscaling, no failures)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from common.kv_transfer import KvBlocks
from fleet_sim.clock import EventLoop
from fleet_sim.pool import RouterQueue
from fleet_sim.records import RequestRecord
from fleet_sim.replica import ReplicaConfig, SimReplica, engine_request
from fleet_sim.routers import SimRouter
from fleet_sim.trace import SimRequest
from replica_engine.outputs import CoreOutput
from replica_engine.scheduler.step_time_model import StepTime


@dataclass(frozen=True)
class KvLink:
    """How KV moves from a prefill replica: a fixed cost per transfer and a rate per sender."""

    name: str
    latency_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class DisaggregatedConfig:
    num_prefill: int
    num_decode: int
    prefill: ReplicaConfig
    decode: ReplicaConfig
    link: KvLink
    kv_bytes_per_token: float  # K and V of every layer, per token
    hop_s: float = 0.002  # the Ingress's call to the decode deployment, after the prefill's
    max_ongoing_requests: int = 10**9  # per replica (Ray Serve LLM's: the engine queues)
    report_period_s: float = 0.5

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("num_prefill and num_decode: each must be >= 1")
        if self.prefill.block_size != self.decode.block_size:
            raise ValueError("prefill and decode: blocks move only between equal block sizes")


class DisaggregatedFleet:
    def __init__(
        self,
        config: DisaggregatedConfig,
        prefill_time: StepTime,
        decode_time: StepTime,
        prefill_router: SimRouter,
        decode_router: SimRouter,
    ) -> None:
        self.config = config
        self.loop = EventLoop()
        self.records: dict[str, RequestRecord] = {}
        self.bytes_moved = 0.0
        self.transfers: list[tuple[float, float]] = []  # each one's export, and arrival at a decode replica
        prefill = [
            SimReplica(f"prefill-{i}", config.prefill, prefill_time, self.loop, self._on_prefilled)
            for i in range(config.num_prefill)
        ]
        decode = [
            SimReplica(f"decode-{i}", config.decode, decode_time, self.loop, self._on_token)
            for i in range(config.num_decode)
        ]
        limit = config.max_ongoing_requests
        self.prefill = RouterQueue(prefill_router, prefill, limit, self.loop)
        self.decode = RouterQueue(decode_router, decode, limit, self.loop)
        self._link_free_at = {replica.replica_id: 0.0 for replica in prefill}
        self._requests: dict[str, SimRequest] = {}  # by the prefill replica's request id
        self._num_unfinished = 0

    def run(self, requests: Sequence[SimRequest]) -> list[RequestRecord]:
        """Serve every request; their records, in the order given."""
        for request in requests:
            if request.next_turn is not None:
                raise ValueError(f"request {request.request_id!r}: conversations are not simulated here")
            self.records[request.request_id] = RequestRecord(request)
            self._num_unfinished += 1
            self.loop.call_at(request.arrival_s, functools.partial(self._arrive, request))
        period = self.config.report_period_s
        for pool in (self.prefill, self.decode):
            for index, replica in enumerate(pool.replicas):
                report = functools.partial(pool.report_every, replica, period, 0.0, self._going)
                self.loop.call_later(period * (index % 8) / 8, report)  # out of step, as Serve's
        self.loop.run()
        return list(self.records.values())

    def _going(self) -> bool:
        return self._num_unfinished > 0

    def _arrive(self, request: SimRequest) -> None:
        self.prefill.push(request, functools.partial(self._start_prefill, request))

    def _start_prefill(self, request: SimRequest, replica: SimReplica) -> None:
        engine = engine_request(replace(request, request_id=f"{request.request_id}/prefill", max_tokens=1))
        engine.kv_export = True
        self._requests[engine.request_id] = request
        replica.submit(engine)

    def _on_prefilled(self, replica: SimReplica, output: CoreOutput, now: float) -> None:
        """The prefill's one token: its blocks leave on the replica's link, then go to a decode replica."""
        if not output.finished:
            return
        request = self._requests.pop(output.request_id)
        self.prefill.router.on_finished(request, now)
        self.prefill.dispatch()
        kv = output.kv
        num_tokens = kv.num_blocks * self.config.prefill.block_size if kv is not None else 0
        num_bytes = num_tokens * self.config.kv_bytes_per_token
        link = self.config.link
        start = max(now, self._link_free_at[replica.replica_id])
        sent = start + num_bytes / link.bytes_per_s
        self._link_free_at[replica.replica_id] = sent
        arrives = sent + link.latency_s + self.config.hop_s
        self.bytes_moved += num_bytes
        self.transfers.append((now, arrives))
        start_decode = functools.partial(self._start_decode, request, kv)
        self.loop.call_at(arrives, lambda: self.decode.push(request, start_decode))

    def _start_decode(self, request: SimRequest, kv: KvBlocks | None, replica: SimReplica) -> None:
        record = self.records[request.request_id]
        record.replica_id, record.routed_s = replica.replica_id, self.loop.now
        replica.submit(engine_request(request), kv)

    def _on_token(self, replica: SimReplica, output: CoreOutput, now: float) -> None:
        record = self.records[output.request_id]
        if not record.take(output, now):
            return
        self._num_unfinished -= 1
        self.decode.router.on_finished(record.request, now)
        self.decode.dispatch()
