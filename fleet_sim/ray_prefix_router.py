"""Ray 2.60's PrefixCacheAffinityRouter, its decision logic on the simulator's clock, around Ray's
own PrefixTree (ray/llm/_internal/serve/routing_policies/prefix_aware/, read there): with Ray's
defaults, no load guard (imbalanced_threshold = inf), a 10% match-rate threshold, no eviction.

A request's prompt goes into the tree when it is routed (never its output), under the replica it
went to; the tree is never told what a replica evicted. A prompt matching 10% or more goes to the
replicas owning the longest matched node; below that, to the replicas with the fewest characters
in the tree (a new replica: all of them); Serve then takes the one of that group with the fewest
ongoing requests, and waits for room there if all are full. Ray matches characters of the prompt
text; here each token is one character, so match rates are in tokens."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence

from common.routing_stats import RoutingStats
from fleet_sim.replica import SimReplica
from fleet_sim.routers import two_choices
from fleet_sim.trace import SimRequest


def prompt_text(request: SimRequest) -> str:
    return "".join(map(chr, request.prompt_token_ids))


class RayPrefixCacheAffinity:
    def __init__(
        self, rng: random.Random, imbalanced_threshold: float = math.inf, match_rate_threshold: float = 0.1
    ) -> None:
        # Ray's class as Ray ships it (its module imports Ray, so only this router loads it).
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

        self.rng = rng
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.tree = PrefixTree()
        self._tenants: set[str] = set()

    def rank(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> list[SimReplica]:
        self._update_tenants([replica.replica_id for replica in replicas], now)
        queue_lens = [replica.num_ongoing for replica in replicas]
        if max(queue_lens) - min(queue_lens) > self.imbalanced_threshold:
            return two_choices(self.rng, replicas)
        text = prompt_text(request)
        by_id = {replica.replica_id: replica for replica in replicas}
        matched, owners = self.tree.prefix_match(text, list(by_id))
        if len(matched) / len(text) < self.match_rate_threshold:
            owners = self.tree.get_smallest_tenants()
        if not owners:
            return two_choices(self.rng, replicas)
        return sorted((by_id[owner] for owner in owners if owner in by_id), key=lambda r: r.num_ongoing)

    def _update_tenants(self, replica_ids: list[str], now: float) -> None:
        """As Ray's update_replicas: new replicas join the tree empty, gone ones leave it."""
        added = [r for r in replica_ids if r not in self._tenants]
        if added:
            self.tree.add_tenants(added, now)
            self._tenants.update(added)

    def on_routed(self, request: SimRequest, replica: SimReplica, now: float) -> None:
        self.tree.insert(prompt_text(request), replica.replica_id, now)

    def on_finished(self, request: SimRequest, now: float) -> None:
        pass

    def on_report(self, replica_id: str, stats: RoutingStats, now: float) -> None:
        pass

    def keep_only(self, replica_ids: Iterable[str]) -> None:
        gone = self._tenants - set(replica_ids)
        if gone:
            self.tree.remove_tenants(sorted(gone))
            self._tenants -= gone
