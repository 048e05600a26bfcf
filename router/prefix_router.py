"""KVPrefixRouter (`request_router: kv_prefix`, the default): Serve's RequestRouter for
EngineReplicas that sends a request where its prompt's leading KV blocks already are, weighed
against load (router/prefix_policy.py says how).

The Ingress sends token ids, so this router hashes the prompt's full blocks exactly as the
replicas' prefix caches do (common/block_hash.py, chained from the root the replicas report) and
looks them up in each replica's reported BlockSummary and in what it sent there since
(router/prefix_index.py). Requests with a `cache_salt` are routed by load alone: their chain
starts from a salted root (a tenant's private cache), which the replicas do not report."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RunningReplica

from common.block_hash import BlockHash, chain_block_hashes
from common.messages import GenerateRequest
from common.metrics_sinks import MetricsSink, RayServeSink
from common.routing_stats import RoutingStats
from router.kv_router import KVPressureRouter
from router.prefix_index import PrefixIndex
from router.prefix_policy import PrefixPolicy, rank_by_prefix

OVERLAP_METRIC = "stallfree_router_prefix_overlap_tokens"
OVERLAP_BUCKETS = (1, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)  # Ray: bounds > 0; le=1 is "none"
MAX_PENDING_DECISIONS = 4096  # requests chosen for but not yet routed: bounded, as some are cancelled


@dataclass
class _Pending:
    keys: list[BlockHash]
    reasons: dict[Any, str]  # replica -> why it ranked where it did
    overlap_tokens: dict[Any, int]  # replica -> prompt tokens it held at decision time


class KVPrefixRouter(KVPressureRouter):
    def initialize_state(
        self, sink: MetricsSink | None = None, policy: PrefixPolicy | None = None, **kwargs: Any
    ) -> None:
        sink = sink or RayServeSink()
        super().initialize_state(sink)
        self.policy = policy or PrefixPolicy()
        self.index = PrefixIndex()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._overlap = sink.histogram(
            OVERLAP_METRIC,
            "Prompt tokens the chosen replica already held (prefix cache) when a request was routed",
            OVERLAP_BUCKETS,
            ("target_replica",),
        )

    def rank(
        self,
        stats: dict[ReplicaID, RoutingStats | None],
        queue_lens: dict[ReplicaID, int],
        pending_request: PendingRequest | None,
        now: float,
    ) -> list[tuple[ReplicaID, str]]:
        for replica_id, replica_stats in stats.items():  # Serve updates a replica's stats in place
            if replica_stats is not None:
                self.index.observe(replica_id, replica_stats)
        pending = self._pending_for(pending_request, stats)
        keys = pending.keys if pending is not None else []
        decision = rank_by_prefix(self.policy, self.tracker, self.index, stats, queue_lens, keys, now)
        if pending is not None and decision.ranking:
            if not pending.reasons:  # the first decision (Serve may ask again): what the metrics report
                block_size = _block_size(stats)
                pending.reasons = dict(decision.ranking)
                pending.overlap_tokens = {r: blocks * block_size for r, blocks in decision.overlaps.items()}
            # A burst of one conversation must see where its first request went before any lands.
            self.index.on_sent(decision.ranking[0][0], keys, now)
        return decision.ranking

    def _pending_for(
        self, request: PendingRequest | None, stats: dict[ReplicaID, RoutingStats | None]
    ) -> _Pending | None:
        """This request's prompt keys (hashed once, kept across Serve's retries)."""
        if request is None:
            return None
        request_id = request.metadata.internal_request_id
        pending = self._pending.get(request_id)
        if pending is None:
            pending = self._pending[request_id] = _Pending(self._prompt_keys(request, stats), {}, {})
            while len(self._pending) > MAX_PENDING_DECISIONS:
                self._pending.popitem(last=False)
        return pending

    def _prompt_keys(
        self, request: PendingRequest, stats: dict[ReplicaID, RoutingStats | None]
    ) -> list[BlockHash]:
        """The first prompt's full blocks' keys; none for a salted request (routed by load) or
        before any replica has reported its chain root and block size."""
        generate = next((arg for arg in request.args if isinstance(arg, GenerateRequest)), None)
        root = self.index.hash_root(stats)
        if (
            generate is None
            or generate.cache_salt is not None
            or root is None
            or not generate.prompt_token_ids
        ):
            return []
        return chain_block_hashes(root, generate.prompt_token_ids[0], _block_size(stats))

    def observe_reports(self, replicas: list[RunningReplica]) -> None:
        super().observe_reports(replicas)
        self.index.keep_only(replica.replica_id for replica in replicas)

    def new_kv_tokens(self, pending_request: PendingRequest, replica_id: ReplicaID) -> int:
        """Less the prompt blocks the replica already holds: those are shared, not added."""
        pending = self._pending.get(pending_request.metadata.internal_request_id)
        held = pending.overlap_tokens.get(replica_id, 0) if pending is not None else 0
        return max(0, super().new_kv_tokens(pending_request, replica_id) - held)

    def routed_reason(self, pending_request: PendingRequest, replica_id: ReplicaID) -> str:
        pending = self._pending.get(pending_request.metadata.internal_request_id)
        if pending is None or replica_id not in pending.reasons:  # not ranked here: as kv_pressure
            return super().routed_reason(pending_request, replica_id)
        return pending.reasons[replica_id]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        pending = self._pending.pop(pending_request.metadata.internal_request_id, None)
        if pending is not None:
            self.index.on_sent(replica_id, pending.keys)
            overlap = pending.overlap_tokens.get(replica_id, 0)
            self._overlap.observe(overlap, {"target_replica": replica_id.unique_id})


def _block_size(stats: dict[ReplicaID, RoutingStats | None]) -> int:
    return next((s.block_size for s in stats.values() if s is not None), 16)
