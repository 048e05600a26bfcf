"""KVPressureRouter: Serve's RequestRouter for EngineReplicas, ranking by predicted KV pressure.

Serve asks `choose_replicas` for ranks of replicas; it then tries them in order, and a replica
at `max_ongoing_requests` refuses, so Serve's backpressure stays in force. We answer one replica
per rank, best first (router/pressure.py says how)."""

from __future__ import annotations

import random
import time
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from deployments.messages import GenerateRequest
from replica_engine.metrics.sinks import Counter, MetricsSink, RayServeSink
from router.pressure import PressureTracker, ReplicaLoad

ROUTED_METRIC = "stallfree_router_requests_routed"


def requested_tokens(request: PendingRequest) -> int:
    """What a request will ask of a replica's KV cache, estimated before tokenization."""
    generate = next((arg for arg in request.args if isinstance(arg, GenerateRequest)), None)
    return generate.estimated_tokens() if generate is not None else 0


class KVPressureRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, sink: MetricsSink | None = None, **kwargs: Any) -> None:
        self.tracker = PressureTracker()
        self._routed: Counter = (sink or RayServeSink()).counter(
            ROUTED_METRIC,
            "Requests routed to an EngineReplica, by replica and reason",
            ("target_replica", "reason"),
        )

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        candidates = list(candidate_replicas)
        random.shuffle(candidates)  # equal pressure and queue: spread, not always the first
        by_id = {replica.replica_id: replica for replica in candidates}
        queue_lens = {
            replica_id: queue_len
            for replica_id in by_id
            if (queue_len := self.replica_queue_len_cache.get(replica_id)) is not None
        }
        stats = {replica_id: replica.routing_stats for replica_id, replica in by_id.items()}
        ranking = self.tracker.rank(by_id, stats, queue_lens)
        if pending_request is not None and ranking:
            # Count it on its likeliest replica now; on_request_routed corrects the guess.
            self.tracker.on_sent(
                pending_request.metadata.internal_request_id, ranking[0][0], requested_tokens(pending_request)
            )
        return [[by_id[replica_id]] for replica_id, _ in ranking]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve calls this as new replica reports arrive: note when each was received."""
        super().update_replicas(replicas)
        now = time.monotonic()
        for replica in replicas:
            load = ReplicaLoad.parse(replica.routing_stats)
            if load is not None:
                self.tracker.observe(replica.replica_id, load, now)
        self.tracker.keep_only(replica.replica_id for replica in replicas)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        request_id = pending_request.metadata.internal_request_id
        # The reason follows from the chosen replica's report, so no per-request state is kept
        # (state per pending request would leak for requests cancelled before routing).
        replica = self.curr_replicas.get(replica_id)
        reason = self.tracker.reason(
            replica_id, ReplicaLoad.parse(replica.routing_stats if replica else None)
        )
        self.tracker.on_sent(request_id, replica_id, requested_tokens(pending_request))
        self._routed.inc(1, {"target_replica": replica_id.unique_id, "reason": reason})

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.tracker.on_finished(internal_request_id)
