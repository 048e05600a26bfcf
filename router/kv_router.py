"""KVPressureRouter: Serve's RequestRouter for EngineReplicas, ranking by predicted KV pressure.

Serve asks `choose_replicas` for ranks of replicas; it then tries them in order, and a replica
at `max_ongoing_requests` refuses, so Serve's backpressure stays in force. We answer one replica
per rank, best first (router/pressure.py says how)."""

from __future__ import annotations

import logging
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
from common.routing_stats import MalformedRoutingStats, RoutingStats
from router.pressure import PressureTracker

ROUTED_METRIC = "stallfree_router_requests_routed"
MALFORMED_METRIC = "stallfree_router_malformed_routing_stats"

logger = logging.getLogger(__name__)


def requested_tokens(request: PendingRequest) -> int:
    """Prompt + output tokens a request may hold in a replica's KV cache (0 if not ours)."""
    generate = next((arg for arg in request.args if isinstance(arg, GenerateRequest)), None)
    return generate.requested_tokens() if generate is not None else 0


class KVPressureRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, sink: MetricsSink | None = None, **kwargs: Any) -> None:
        sink = sink or RayServeSink()
        self.tracker = PressureTracker()
        self._routed: Counter = sink.counter(
            ROUTED_METRIC,
            "Requests routed to an EngineReplica, by replica and reason",
            ("target_replica", "reason"),
        )
        self._malformed: Counter = sink.counter(
            MALFORMED_METRIC,
            "Routing-stats reports a router could not read (each replica counted once a spell)",
            ("target_replica",),
        )
        self._malformed_replicas: set[ReplicaID] = set()

    def read_stats(self, replica: RunningReplica) -> RoutingStats | None:
        """The replica's latest report; None if it has none yet, or (logged and counted once
        until it sends a good one) if it is malformed: routed as a replica without stats."""
        try:
            stats = RoutingStats.from_report(replica.routing_stats)
        except MalformedRoutingStats as error:
            if replica.replica_id not in self._malformed_replicas:
                self._malformed_replicas.add(replica.replica_id)
                logger.error("replica %s sent malformed routing stats: %s", replica.replica_id, error)
                self._malformed.inc(1, {"target_replica": replica.replica_id.unique_id})
            return None
        self._malformed_replicas.discard(replica.replica_id)
        return stats

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
        stats = {replica_id: self.read_stats(replica) for replica_id, replica in by_id.items()}
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
        stats: dict[ReplicaID, RoutingStats | None],
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
            stats = self.read_stats(replica)
            if stats is not None:
                self.tracker.observe(replica.replica_id, stats, now)
        self.tracker.keep_only(replica.replica_id for replica in replicas)
        self._malformed_replicas &= {replica.replica_id for replica in replicas}

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
        return self.tracker.reason(replica_id, self.read_stats(replica) if replica else None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.tracker.on_finished(internal_request_id)
