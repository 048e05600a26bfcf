"""KVPrefixRouter (`request_router: kv_prefix`, the default): Serve's RequestRouter for
EngineReplicas that sends a request where its first token is predicted soonest: the prompt blocks
a replica holds are prefill it saves, its queue and decodes are time it adds, all priced by the
replica's own step-time model (router/prefix_policy.py says how).

The Ingress sends token ids, so this router hashes the prompt's full blocks exactly as the
replicas' prefix caches do (common/block_hash.py, chained from the root the replicas report) and
looks them up in each replica's reported BlockSummary and in what it sent there since
(router/prefix_index.py). A request with a LoRA adapter hashes from the adapter's root and goes
to the adapter's holders first (router/adapter_affinity.py). Requests with a `cache_salt` are
routed by load alone: their chain starts from a salted root (a tenant's private cache), which the
replicas do not report."""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import ReplicaID

from common.metrics_sinks import MetricsSink, RayServeSink
from router.kv_router import KVPressureRouter
from router.ranking import PrefixRanking, Routed

OVERLAP_METRIC = "stallfree_router_prefix_overlap_tokens"
OVERLAP_BUCKETS = (1, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)  # Ray: bounds > 0; le=1 is "none"


class KVPrefixRouter(KVPressureRouter):
    def initialize_state(self, sink: MetricsSink | None = None, **kwargs: Any) -> None:
        sink = sink or RayServeSink()
        super().initialize_state(sink)
        self._overlap = sink.histogram(
            OVERLAP_METRIC,
            "Prompt tokens the chosen replica already held (prefix cache) when a request was routed",
            OVERLAP_BUCKETS,
            ("target_replica",),
        )

    def new_ranking(self) -> PrefixRanking:
        return PrefixRanking()

    def record_routed(self, replica_id: ReplicaID, routed: Routed) -> None:
        self._overlap.observe(routed.overlap_tokens, {"target_replica": replica_id.unique_id})
