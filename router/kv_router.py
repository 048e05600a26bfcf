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

from common.messages import GenerateRequest
from common.metrics_sinks import Counter, MetricsSink, RayServeSink
from router.pressure import PressureTracker, ReplicaLoad

ROUTED_METRIC = "stallfree_router_requests_routed"


def requested_tokens(request: PendingRequest) -> int:
    """Prompt + output tokens a request may hold in a replica's KV cache (0 if not ours)."""
    generate = next((arg for arg in request.args if isinstance(arg, GenerateRequest)), None)
    return generate.requested_tokens() if generate is not None else 0


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
        now = time.monotonic()
        ranking = self.rank(stats, queue_lens, pending_request, now)
        if pending_request is not None and ranking:
            # Count it on its likeliest replica now; on_request_routed corrects the guess.
            request_id = pending_request.metadata.internal_request_id
            self.tracker.on_sent(
                request_id, ranking[0][0], self.new_kv_tokens(pending_request, ranking[0][0])
            )
        return [[by_id[replica_id]] for replica_id, _ in ranking]

    def rank(
        self,
        stats: dict[ReplicaID, dict[str, Any] | None],
        queue_lens: dict[ReplicaID, int],
        pending_request: PendingRequest | None,
        now: float,
    ) -> list[tuple[ReplicaID, str]]:
        """Replicas best first, each with the reason for its place."""
        return self.tracker.rank(list(stats), stats, queue_lens, now)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve calls this as new replica reports arrive."""
        super().update_replicas(replicas)
        self.observe_reports(replicas)

    def observe_reports(self, replicas: list[RunningReplica]) -> None:
        """Note when each report was received; forget replicas that are gone."""
        now = time.monotonic()
        for replica in replicas:
            load = ReplicaLoad.parse(replica.routing_stats)
            if load is not None:
                self.tracker.observe(replica.replica_id, load, now)
        self.tracker.keep_only(replica.replica_id for replica in replicas)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        reason = self.routed_reason(pending_request, replica_id)
        self.tracker.on_sent(
            pending_request.metadata.internal_request_id,
            replica_id,
            self.new_kv_tokens(pending_request, replica_id),
        )
        self._routed.inc(1, {"target_replica": replica_id.unique_id, "reason": reason})

    def new_kv_tokens(self, pending_request: PendingRequest, replica_id: ReplicaID) -> int:
        """The KV cache tokens the request will add on that replica."""
        return requested_tokens(pending_request)

    def routed_reason(self, pending_request: PendingRequest, replica_id: ReplicaID) -> str:
        # The reason follows from the chosen replica's report, so no per-request state is kept
        # (state per pending request would leak for requests cancelled before routing).
        replica = self.curr_replicas.get(replica_id)
        return self.tracker.reason(replica_id, ReplicaLoad.parse(replica.routing_stats if replica else None))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.tracker.on_finished(internal_request_id)
