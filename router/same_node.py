"""SameNodeRouter: the Ingress's request router. A request goes to an Ingress replica on the node
whose proxy (or handle) it came from whenever one runs there, to another node's only when none
does.

Why strictly: with one Ingress per node, a request kept on its node's Ingress depends on no other
node but its engine replica's; when a node is lost, only the requests whose engine replica was
there fail, and they get 503 `replica_failed` (the Ingress sees the replica die). Serve's default
router only tries its node once, within a 0.1 s queue-length probe; on a loaded host the probe
was missed and the request went to another node's Ingress, lost with that node: its connection
cut mid-stream, with no status or error event to say why."""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, LocalityMixin, PendingRequest, RequestRouter, RunningReplica

from router.queue_probe import QUEUE_LEN_RESPONSE_DEADLINE_S


class SameNodeRouter(FIFOMixin, LocalityMixin, RequestRouter):
    queue_len_response_deadline_s = QUEUE_LEN_RESPONSE_DEADLINE_S

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """One rank: this node's replicas, or every replica if none is here. Serve takes the one
        with the shortest queue (shuffled: ties spread); when none can take the request it backs
        off and asks again, so a busy local Ingress is waited for, not passed over."""
        local = [replica for replica in candidate_replicas if replica.node_id == self._self_node_id]
        rank = local or list(candidate_replicas)
        return [random.sample(rank, len(rank))] if rank else []
