"""KVPressureRouter: Serve's RequestRouter for EngineReplicas, ranking by predicted KV pressure.

Serve asks `choose_replicas` for ranks of replicas; it then tries them in order, and a replica
at `max_ongoing_requests` refuses, so Serve's backpressure stays in force. We answer one replica
per rank, best first (router/pressure.py says how); a request with a LoRA adapter to the
replicas holding it first, unless they are overloaded (router/adapter_affinity.py)."""

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

from common.messages import RoutedMessage
from common.metrics_sinks import Counter, MetricsSink, RayServeSink
from common.routing_stats import MalformedRoutingStats, RoutingStats
from router.queue_probe import QUEUE_LEN_RESPONSE_DEADLINE_S
from router.ranking import PressureRanking, Routed, RoutedRequest

ROUTED_METRIC = "stallfree_router_requests_routed"
MALFORMED_METRIC = "stallfree_router_malformed_routing_stats"

logger = logging.getLogger(__name__)


def routed_request(request: PendingRequest) -> RoutedRequest:
    """What the ranking reads of a Serve request (not ours: no tokens, routed by load)."""
    ours = next((arg for arg in request.args if isinstance(arg, RoutedMessage)), None)
    request_id = request.metadata.internal_request_id
    if ours is None:
        return RoutedRequest(request_id, 0)
    prompt = ours.prompt_token_ids[0] if ours.prompt_token_ids else ()
    return RoutedRequest(request_id, ours.requested_tokens(), prompt, ours.cache_salt, ours.lora)


class KVPressureRouter(FIFOMixin, RequestRouter):
    queue_len_response_deadline_s = QUEUE_LEN_RESPONSE_DEADLINE_S  # Serve's 0.1 s: too short for CPU replicas

    def initialize_state(self, sink: MetricsSink | None = None, **kwargs: Any) -> None:
        sink = sink or RayServeSink()
        self.ranking = self.new_ranking()
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

    def new_ranking(self) -> PressureRanking:
        return PressureRanking()

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
        request = routed_request(pending_request) if pending_request is not None else None
        ranking = self.ranking.rank(stats, queue_lens, request, time.monotonic())
        return [[by_id[replica_id]] for replica_id, _ in ranking]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve calls this as new replica reports arrive."""
        super().update_replicas(replicas)
        self.observe_reports(replicas)

    def observe_reports(self, replicas: list[RunningReplica]) -> None:
        """Note when each report was received; forget replicas that are gone.

        A new report also refreshes Serve's cached queue length of its replica: the calls it
        serves (a request of n choices once, as Serve counts). Serve probes a replica whose cached
        length is over 10 s old before sending to it, and on a loaded host a probe can miss even
        our 1 s: the request then went past the replica holding its adapter or prefix (CI saw
        it). A replica that reports answered its controller within the last 0.5 s; one over its
        max_ongoing_requests still refuses."""
        now = time.monotonic()
        for replica in replicas:
            stats = self.read_stats(replica)
            if stats is not None and self.ranking.observe(replica.replica_id, stats, now) == now:
                self.replica_queue_len_cache.update(replica.replica_id, stats.num_ongoing_requests)
        self.ranking.keep_only(replica.replica_id for replica in replicas)
        self._malformed_replicas &= {replica.replica_id for replica in replicas}

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        stats = self.current_stats(replica_id)
        routed = self.ranking.on_routed(routed_request(pending_request), replica_id, stats)
        self._routed.inc(1, {"target_replica": replica_id.unique_id, "reason": routed.reason})
        self.record_routed(replica_id, routed)

    def routed_reason(self, pending_request: PendingRequest | None, replica_id: ReplicaID) -> str:
        """Why a request sent to this replica goes there (the routing metric's `reason`)."""
        request = routed_request(pending_request) if pending_request is not None else None
        return self.ranking.reason(request, replica_id, self.current_stats(replica_id), None)

    def current_stats(self, replica_id: ReplicaID) -> RoutingStats | None:
        replica = self.curr_replicas.get(replica_id)
        return self.read_stats(replica) if replica else None

    def record_routed(self, replica_id: ReplicaID, routed: Routed) -> None:
        """More metrics of a routed request (the prefix router's overlap)."""

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.ranking.on_finished(internal_request_id)
