"""SGLang's sgl-router cache-aware policy (sgl-router/src/policies/cache_aware.rs, read there, with
the fallback as changed on 2025-12-08, PR #14650), its decision logic on the simulator's clock,
around Ray's PrefixTree as the approximate radix tree (the same structure: characters, a tenant
per worker, a per-tenant LRU; sgl-router's own tree is Rust):

1. Load is the router's own count of requests it sent a worker and that have not finished.
2. The fleet is imbalanced when max load - min load > balance_abs_threshold and max load >
   min load * balance_rel_threshold: the request goes to the least loaded worker (first on ties).
3. Otherwise the prompt is matched in the tree: a match rate (matched / prompt characters) above
   cache_threshold sends it to a worker owning the matched node (sgl-router takes its map's first,
   an arbitrary one; here a seeded choice), else to the least loaded worker.
4. The prompt is inserted under the chosen worker either way (never its output); every
   eviction_interval_s each worker's part of the tree is cut, least recently used first, to
   max_tree_size characters.

Defaults are the router's command line's (sglang_router/router_args.py). Here each token is one
character, so rates are in tokens, and the tree's size in tokens."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.routing_stats import RoutingStats
from fleet_sim.ray_prefix_router import prompt_text
from fleet_sim.replica import SimReplica
from fleet_sim.trace import SimRequest


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size: int = 2**26


class SGLangCacheAware:
    def __init__(self, rng: random.Random, config: CacheAwareConfig = CacheAwareConfig()) -> None:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

        self.rng = rng
        self.config = config
        self.tree = PrefixTree()
        self._load: dict[str, int] = {}
        self._sent_to: dict[str, str] = {}  # request id -> worker, until it finishes
        self._next_eviction_s = config.eviction_interval_s

    def load(self, replica_id: str) -> int:
        return self._load.get(replica_id, 0)

    def rank(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> list[SimReplica]:
        workers = [replica.replica_id for replica in replicas]
        self.join(workers, now)
        self.evict_if_due(now)
        chosen = self.choose(prompt_text(request), workers)
        by_load = sorted(replicas, key=lambda replica: self.load(replica.replica_id))
        return sorted(by_load, key=lambda replica: replica.replica_id != chosen)  # then by load, if full

    def choose(self, text: str, workers: list[str]) -> str:
        """The worker sgl-router picks for a prompt of `text` among `workers` (in their order)."""
        loads = [self.load(worker) for worker in workers]
        least_loaded = workers[loads.index(min(loads))]
        config = self.config
        if max(loads) - min(loads) > config.balance_abs_threshold and max(loads) > min(loads) * (
            config.balance_rel_threshold
        ):
            return least_loaded
        matched, owners = self.tree.prefix_match(text, workers)
        rate = len(matched) / len(text) if text else 0.0
        if rate > config.cache_threshold and owners:
            return self.rng.choice(sorted(owners))
        return least_loaded

    def join(self, replica_ids: list[str], now: float) -> None:
        added = [r for r in replica_ids if r not in self.tree.tenant_to_char_count]
        if added:
            self.tree.add_tenants(added, now)

    def evict_if_due(self, now: float) -> None:
        if now < self._next_eviction_s:
            return
        self._next_eviction_s = now + self.config.eviction_interval_s
        for tenant, size in list(self.tree.tenant_to_char_count.items()):
            if size > self.config.max_tree_size:
                self.tree.evict_tenant_by_lru(tenant, size - self.config.max_tree_size)

    def on_routed(self, request: SimRequest, replica: SimReplica, now: float) -> None:
        self.dispatched(request.request_id, prompt_text(request), replica.replica_id, now)

    def dispatched(self, request_id: str, text: str, worker: str, now: float) -> None:
        """sgl-router's bookkeeping once it picked `worker`: the prompt into the tree, load + 1."""
        self.tree.insert(text, worker, now)
        self._load[worker] = self.load(worker) + 1
        self._sent_to[request_id] = worker

    def on_finished(self, request: SimRequest, now: float) -> None:
        self.completed(request.request_id)

    def completed(self, request_id: str) -> None:
        """Its response ended: load - 1 (the tree is not told)."""
        worker = self._sent_to.pop(request_id, None)
        if worker is not None:
            self._load[worker] = max(0, self.load(worker) - 1)

    def on_report(self, replica_id: str, stats: RoutingStats, now: float) -> None:
        pass

    def keep_only(self, replica_ids: Iterable[str]) -> None:
        gone = set(self.tree.tenant_to_char_count) - set(replica_ids)
        if gone:
            self.tree.remove_tenants(sorted(gone))
            for replica_id in gone:
                self._load.pop(replica_id, None)
