"""The kv_prefix decision, pure (no Ray): rank replicas by the prefill a request would cost there
plus the KV load it would leave there, NVIDIA Dynamo's router cost:

    new = prompt blocks - blocks the replica holds
    cost = prefill_weight * new + (predicted KV blocks in use + new)

A block the replica holds is saved twice: not computed, and shared rather than added. The
predicted KV load is the KV-pressure router's (router/pressure.py: the last report plus what was
sent since), so with no overlap anywhere this ranks as kv_pressure does. A load guard keeps a
hot prefix from piling everything on one replica: when the cheapest replica's load exceeds the
least loaded one's by more than a threshold (KV pressure or requests), the request goes by load.
Replicas with stale or missing stats rank after the fresh ones by queue length, as in kv_pressure."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.block_hash import BlockHash
from router.prefix_index import PrefixIndex
from router.pressure import BY_KV, PressureTracker, ReplicaLoad

BY_PREFIX = "prefix-hit"  # fresh stats, chosen replica holds part of the prompt
BY_LOAD_GUARD = "load-guard"  # the cheapest replica was too loaded: ranked by KV pressure instead


@dataclass(frozen=True)
class PrefixPolicy:
    prefill_weight: float = 1.0  # a block to prefill against a block of KV load (Dynamo's default)
    max_kv_imbalance: float = 0.25  # pressure (fraction of the pool) above the least pressed
    max_request_imbalance: float = 0.5  # requests above the least busy, as a fraction of its count,
    request_slack: int = 4  # ... plus this many (so a few requests never trip it)


@dataclass(frozen=True)
class Decision:
    ranking: list[tuple[Hashable, str]]  # replicas best first, each with the reason for its place
    overlaps: dict[Hashable, int]  # leading prompt blocks each fresh replica holds


@dataclass(frozen=True)
class _Candidate:
    replica: Hashable
    overlap: int
    cost: float
    pressure: float
    num_requests: int
    queue_len: float


def rank_by_prefix(
    policy: PrefixPolicy,
    tracker: PressureTracker,
    index: PrefixIndex,
    stats: Mapping[Hashable, Mapping[str, Any] | None],
    queue_lens: Mapping[Hashable, int],
    prompt_keys: Sequence[BlockHash],
    num_prompt_blocks: int,
    now: float,
) -> Decision:
    """`prompt_keys`: the prompt's full blocks' keys (empty: route by load alone)."""
    by_load = tracker.rank(list(stats), stats, queue_lens, now)
    fresh = [replica for replica, reason in by_load if reason == BY_KV]
    if not prompt_keys or not fresh:
        return Decision(by_load, {})
    candidates = []
    for replica in fresh:
        load = ReplicaLoad.parse(stats[replica])
        assert load is not None
        pressure = tracker.pressure(replica, load, now)
        overlap = index.overlap(replica, prompt_keys, now)
        load_blocks = pressure * max(1, load.num_total_blocks)
        new_blocks = num_prompt_blocks - overlap
        cost = policy.prefill_weight * new_blocks + load_blocks + new_blocks
        num_requests = load.num_waiting + load.num_running + tracker.in_flight_requests(replica)
        queue_len = queue_lens.get(replica, math.inf)
        candidates.append(_Candidate(replica, overlap, cost, pressure, num_requests, queue_len))
    candidates.sort(key=lambda c: (c.cost, c.queue_len))
    overlaps = {c.replica: c.overlap for c in candidates}
    stale = [(replica, reason) for replica, reason in by_load if reason != BY_KV]
    guard = _load_guard(policy, candidates[0], candidates)
    if candidates[0].overlap and guard is not None:
        candidates.sort(key=guard)
        return Decision([(c.replica, BY_LOAD_GUARD) for c in candidates] + stale, overlaps)
    ranked = [(c.replica, BY_PREFIX if c.overlap else BY_KV) for c in candidates]
    return Decision(ranked + stale, overlaps)


def _load_guard(
    policy: PrefixPolicy, best: _Candidate, candidates: list[_Candidate]
) -> Callable[[_Candidate], tuple[float, ...]] | None:
    """None if `best` is loaded within bounds; else how to rank instead: by the load it exceeds."""
    least_pressure = min(c.pressure for c in candidates)
    least_requests = min(c.num_requests for c in candidates)
    if best.pressure - least_pressure > policy.max_kv_imbalance:
        return lambda c: (c.pressure, c.num_requests, c.queue_len)
    if best.num_requests > least_requests * (1 + policy.max_request_imbalance) + policy.request_slack:
        return lambda c: (c.num_requests, c.pressure, c.queue_len)
    return None
