"""RoundRobinRouter: each request to the next replica in turn, blind to load. A baseline for
bench/serving/router.py, beside Serve's power-of-two router."""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class RoundRobinRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs: object) -> None:
        self._turn = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        start = self._turn % len(ordered)
        self._turn += 1
        return [[replica] for replica in ordered[start:] + ordered[:start]]
