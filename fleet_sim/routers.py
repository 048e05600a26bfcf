"""The routers a simulated fleet can use: ours (router/ranking.py, the code the Serve routers
run), the baselines as Serve runs them, and SGLang's and llm-d's routers from their published
logic. A router ranks replicas; the fleet tries them in order, skipping those at
max_ongoing_requests, as Serve does."""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol

from common.routing_stats import RoutingStats
from fleet_sim.replica import SimReplica
from fleet_sim.trace import SimRequest
from router.ranking import PrefixRanking, PressureRanking, RoutedRequest


class SimRouter(Protocol):
    """`rank`: the replicas the request may go to, best first; one not listed is never tried."""

    def rank(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> list[SimReplica]: ...

    def on_routed(self, request: SimRequest, replica: SimReplica, now: float) -> None: ...

    def on_finished(self, request: SimRequest, now: float) -> None: ...

    def on_report(self, replica_id: str, stats: RoutingStats, now: float) -> None: ...

    def keep_only(self, replica_ids: Iterable[str]) -> None: ...


class Blind:
    """A router that reads no reports and keeps no state per request."""

    def on_routed(self, request: SimRequest, replica: SimReplica, now: float) -> None:
        pass

    def on_finished(self, request: SimRequest, now: float) -> None:
        pass

    def on_report(self, replica_id: str, stats: RoutingStats, now: float) -> None:
        pass

    def keep_only(self, replica_ids: Iterable[str]) -> None:
        pass


class RoundRobin(Blind):
    """router/round_robin.py: each request to the next replica in turn, by replica id."""

    def __init__(self) -> None:
        self._turn = 0

    def rank(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> list[SimReplica]:
        ordered = sorted(replicas, key=lambda replica: replica.replica_id)
        start = self._turn % len(ordered)
        self._turn += 1
        return ordered[start:] + ordered[:start]


def two_choices(rng: random.Random, replicas: Sequence[SimReplica]) -> list[SimReplica]:
    """Serve's power of two: two replicas at random, the one with fewer ongoing requests first.
    Serve draws two more when both are full; the rest in random order stands for those draws."""
    shuffled = list(replicas)
    rng.shuffle(shuffled)
    return sorted(shuffled[:2], key=lambda replica: replica.num_ongoing) + shuffled[2:]


class PowerOfTwo(Blind):
    """Serve's default router."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def rank(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> list[SimReplica]:
        return two_choices(self.rng, replicas)


class Ranked:
    """kv_pressure or kv_prefix: our ranking code on the reports the replicas published, with
    the exact ongoing counts standing for Serve's queue-length cache."""

    def __init__(self, ranking: PressureRanking, rng: random.Random) -> None:
        self.ranking = ranking
        self.rng = rng
        self._stats: dict[Hashable, RoutingStats] = {}

    def rank(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> list[SimReplica]:
        candidates = list(replicas)
        self.rng.shuffle(candidates)  # as the Serve router does: ties spread
        by_id = {replica.replica_id: replica for replica in candidates}
        stats = {replica_id: self._stats.get(replica_id) for replica_id in by_id}
        queue_lens = {replica.replica_id: replica.num_ongoing for replica in candidates}
        ranking = self.ranking.rank(stats, queue_lens, routed_request(request), now)
        return [by_id[replica_id] for replica_id, _ in ranking]

    def on_routed(self, request: SimRequest, replica: SimReplica, now: float) -> None:
        stats = self._stats.get(replica.replica_id)
        self.ranking.on_routed(routed_request(request), replica.replica_id, stats, now)

    def on_finished(self, request: SimRequest, now: float) -> None:
        self.ranking.on_finished(request.request_id, now)

    def on_report(self, replica_id: str, stats: RoutingStats, now: float) -> None:
        self._stats[replica_id] = stats
        self.ranking.observe(replica_id, stats, now)

    def keep_only(self, replica_ids: Iterable[str]) -> None:
        current = set(replica_ids)
        self._stats = {r: stats for r, stats in self._stats.items() if r in current}
        self.ranking.keep_only(current)


def routed_request(request: SimRequest) -> RoutedRequest:
    requested = len(request.prompt_token_ids) + request.max_tokens
    return RoutedRequest(
        request.request_id, requested, request.prompt_token_ids, request.cache_salt, request.lora_request
    )


def _ray_prefix_cache_affinity(rng: random.Random) -> SimRouter:
    from fleet_sim.ray_prefix_router import RayPrefixCacheAffinity  # imports Ray

    return RayPrefixCacheAffinity(rng)


def _sglang_cache_aware(rng: random.Random) -> SimRouter:
    from fleet_sim.sglang_router import SGLangCacheAware  # imports Ray (its PrefixTree)

    return SGLangCacheAware(rng)


def _llmd_precise_prefix(rng: random.Random) -> SimRouter:
    from fleet_sim.llmd_router import LLMDPrecisePrefix

    return LLMDPrecisePrefix(rng)


ROUTERS = {
    "kv_prefix": lambda rng: Ranked(PrefixRanking(), rng),
    "kv_pressure": lambda rng: Ranked(PressureRanking(), rng),
    "prefix_cache_affinity": _ray_prefix_cache_affinity,
    "sglang_cache_aware": _sglang_cache_aware,
    "llmd_precise_prefix": _llmd_precise_prefix,
    "power_of_two": PowerOfTwo,
    "round_robin": lambda rng: RoundRobin(),
}


def make_router(name: str, seed: int) -> SimRouter:
    """A router by its serve_config name (`request_router`)."""
    if name not in ROUTERS:
        raise ValueError(f"request_router: {name!r} is not one the simulator models ({', '.join(ROUTERS)})")
    return ROUTERS[name](random.Random(seed))
