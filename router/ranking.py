"""What the kv_pressure and kv_prefix routers decide, pure (no Ray): the ranking for a request,
and the bookkeeping when it is routed or finishes. The Serve routers (kv_router.py,
prefix_router.py) adapt Serve's requests and replicas to it; the fleet simulator (fleet_sim/)
calls it directly on its virtual clock, so both route with the same code."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from common.block_hash import BlockHash, adapter_root, chain_block_hashes
from common.lora import LoRARequest
from common.routing_stats import RoutingStats
from router.adapter_affinity import BY_ADAPTER, AdapterIndex, AdapterPolicy, prefer_holders
from router.prefix_index import PrefixIndex
from router.prefix_policy import rank_by_prefix
from router.pressure import BY_KV, PressureTracker

MAX_PENDING_DECISIONS = 4096  # requests chosen for but not yet routed: bounded, as some are cancelled

ADAPTER_POLICY = AdapterPolicy()
Stats = Mapping[Hashable, RoutingStats | None]  # each candidate replica's latest report (None: none yet)


@dataclass(frozen=True)
class RoutedRequest:
    """What a router reads of a request."""

    request_id: Hashable
    requested_tokens: int  # prompt + output tokens it may hold in a replica's KV cache
    prompt_token_ids: Sequence[int] = ()  # its (first) prompt; empty: routed by load alone
    cache_salt: str | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)


@dataclass(frozen=True)
class Routed:
    """Why a routed request went where it did (the routing metrics' labels)."""

    reason: str
    overlap_tokens: int = 0  # prompt tokens the replica held when it was ranked


class PressureRanking:
    """kv_pressure: replicas by predicted KV pressure (router/pressure.py); a request with a LoRA
    adapter to those holding it first, unless overloaded (router/adapter_affinity.py).
    `adapter_policy` None: adapters ignored (the simulator's baseline)."""

    def __init__(self, adapter_policy: AdapterPolicy | None = ADAPTER_POLICY) -> None:
        self.tracker = PressureTracker()
        self.adapter_policy = adapter_policy
        self.adapters = AdapterIndex()

    def observe(self, replica: Hashable, stats: RoutingStats, now: float | None = None) -> float:
        """When this router first saw the report (now, if it is new)."""
        self.adapters.observe(replica, stats)
        return self.tracker.observe(replica, stats, now)

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        """Forget replicas that are gone."""
        current = list(replicas)
        self.tracker.keep_only(current)
        self.adapters.keep_only(current)

    def rank(
        self, stats: Stats, queue_lens: Mapping[Hashable, int], request: RoutedRequest | None, now: float
    ) -> list[tuple[Hashable, str]]:
        """Replicas best first, each with the reason for its place."""
        ranking = self._rank(stats, queue_lens, request, now)
        if request is not None and ranking:
            # Count it on its likeliest replica now; on_routed corrects the guess.
            best = ranking[0][0]
            self._on_sent(request, best, now)
            if request.lora is not None:  # a burst of one adapter follows its first request
                self.adapters.on_sent(best, request.lora.name, now)
        return ranking

    def _rank(
        self, stats: Stats, queue_lens: Mapping[Hashable, int], request: RoutedRequest | None, now: float
    ) -> list[tuple[Hashable, str]]:
        return self.adapter_first(self.tracker.rank(list(stats), stats, queue_lens, now), stats, request, now)

    def adapter_first(
        self, ranking: list[tuple[Hashable, str]], stats: Stats, request: RoutedRequest | None, now: float
    ) -> list[tuple[Hashable, str]]:
        """The ranking with the holders of the request's adapter first, if it has one."""
        if request is None or request.lora is None or self.adapter_policy is None:
            return ranking
        for replica, replica_stats in stats.items():  # Serve updates a replica's stats in place
            if replica_stats is not None:
                self.adapters.observe(replica, replica_stats)
        return prefer_holders(
            self.adapter_policy, self.tracker, self.adapters, stats, ranking, request.lora.name, now
        )

    def on_routed(
        self, request: RoutedRequest, replica: Hashable, stats: RoutingStats | None, now: float | None = None
    ) -> Routed:
        """The request went to `replica` (whose latest report is `stats`)."""
        routed = Routed(self.reason(request, replica, stats, now))
        self._on_sent(request, replica, now)
        if request.lora is not None:
            self.adapters.on_sent(replica, request.lora.name, now)
        return routed

    def on_finished(self, request_id: Hashable, now: float | None = None) -> None:
        self.tracker.on_finished(request_id, now)

    def reason(
        self, request: RoutedRequest | None, replica: Hashable, stats: RoutingStats | None, now: float | None
    ) -> str:
        # Follows from the replica's report, so no per-request state is kept (state per pending
        # request would leak for requests cancelled before routing).
        reason = self.tracker.reason(replica, stats, now)
        lora = request.lora if request is not None and self.adapter_policy is not None else None
        if reason == BY_KV and lora is not None and self.adapters.reported(replica, lora.name):
            return BY_ADAPTER
        return reason

    def _on_sent(self, request: RoutedRequest, replica: Hashable, now: float | None) -> None:
        held = self.held_tokens(request, replica)
        new_kv, prefill = request.requested_tokens - held, len(request.prompt_token_ids) - held
        self.tracker.on_sent(request.request_id, replica, max(0, new_kv), now, max(0, prefill))

    def held_tokens(self, request: RoutedRequest, replica: Hashable) -> int:
        """Prompt tokens the replica held when the request was ranked (shared, not added)."""
        return 0


@dataclass
class _Pending:
    keys: list[BlockHash]
    reasons: dict[Hashable, str] = field(default_factory=dict)  # replica -> why it ranked where it did
    overlap_tokens: dict[Hashable, int] = field(default_factory=dict)  # replica -> prompt tokens it held


class PrefixRanking(PressureRanking):
    """kv_prefix: the prompt's full blocks hashed as the replicas' prefix caches do (chained from
    the root the replicas report), looked up in each replica's reported BlockSummary and in what
    was sent there since (router/prefix_index.py); replicas ranked by predicted time to first token
    (router/prefix_policy.py).
    A request with a LoRA adapter hashes from the adapter's root (derived from the reported one,
    common/block_hash.py), and goes to the adapter's holders first (router/adapter_affinity.py).
    A request with a `cache_salt` is ranked by load alone: its chain starts from a salted root
    (a tenant's private cache), which the replicas do not report."""

    def __init__(self, adapter_policy: AdapterPolicy | None = ADAPTER_POLICY) -> None:
        super().__init__(adapter_policy)
        self.index = PrefixIndex()
        self._pending: OrderedDict[Hashable, _Pending] = OrderedDict()

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        current = list(replicas)
        super().keep_only(current)
        self.index.keep_only(current)

    def _rank(
        self, stats: Stats, queue_lens: Mapping[Hashable, int], request: RoutedRequest | None, now: float
    ) -> list[tuple[Hashable, str]]:
        for replica, replica_stats in stats.items():  # Serve updates a replica's stats in place
            if replica_stats is not None:
                self.index.observe(replica, replica_stats)
        pending = self._pending_for(request, stats)
        keys = pending.keys if pending is not None else []
        decision = rank_by_prefix(self.tracker, self.index, stats, queue_lens, keys, now)
        ranking = self.adapter_first(decision.ranking, stats, request, now)
        if pending is not None and ranking:
            if not pending.reasons:  # the first decision (Serve may ask again): what the metrics report
                block_size = _block_size(stats)
                pending.reasons = dict(ranking)
                pending.overlap_tokens = {r: blocks * block_size for r, blocks in decision.overlaps.items()}
            # A burst of one conversation must see where its first request went before any lands.
            self.index.on_sent(ranking[0][0], keys, now)
        return ranking

    def _pending_for(self, request: RoutedRequest | None, stats: Stats) -> _Pending | None:
        """This request's prompt keys (hashed once, kept across Serve's retries)."""
        if request is None:
            return None
        pending = self._pending.get(request.request_id)
        if pending is None:
            pending = self._pending[request.request_id] = _Pending(self._prompt_keys(request, stats))
            while len(self._pending) > MAX_PENDING_DECISIONS:
                self._pending.popitem(last=False)
        return pending

    def _prompt_keys(self, request: RoutedRequest, stats: Stats) -> list[BlockHash]:
        """None for a salted request, or before any replica has reported its chain root."""
        root = self.index.hash_root(stats)
        if request.cache_salt is not None or root is None or not request.prompt_token_ids:
            return []
        root = adapter_root(root, request.lora)
        return chain_block_hashes(root, request.prompt_token_ids, _block_size(stats))

    def held_tokens(self, request: RoutedRequest, replica: Hashable) -> int:
        pending = self._pending.get(request.request_id)
        return pending.overlap_tokens.get(replica, 0) if pending is not None else 0

    def reason(
        self, request: RoutedRequest | None, replica: Hashable, stats: RoutingStats | None, now: float | None
    ) -> str:
        pending = self._pending.get(request.request_id) if request is not None else None
        if pending is None or replica not in pending.reasons:  # not ranked here: as kv_pressure
            return super().reason(request, replica, stats, now)
        return pending.reasons[replica]

    def on_routed(
        self, request: RoutedRequest, replica: Hashable, stats: RoutingStats | None, now: float | None = None
    ) -> Routed:
        routed = super().on_routed(request, replica, stats, now)
        pending = self._pending.pop(request.request_id, None)
        if pending is None:
            return routed
        self.index.on_sent(replica, pending.keys, now)
        return Routed(routed.reason, pending.overlap_tokens.get(replica, 0))


def _block_size(stats: Stats) -> int:
    return next((s.block_size for s in stats.values() if s is not None), 16)
