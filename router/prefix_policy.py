"""The kv_prefix decision, pure (no Ray): each replica's predicted time to first token (TTFT) for
this request, in seconds, from what the replica reported plus what this router sent it since:

    TTFT  = steps * per step + c_prefill * (queued + own) + c_prompt_attention * own's pairs
    steps = ceil((queued + own) / (budget - decodes))      stall-free: decodes first, then chunks
    per step = c0 + c_decode * decodes + c_decode_attention * running context + c_request * (decodes + 1)

`own` is the prompt less the leading blocks the replica holds (its reported Bloom summary and what
this router sent there since, router/prefix_index.py); `queued` is the prompt work its report owes
plus what this router sent since (router/pressure.py). The coefficients are the replica's own
step-time model (common/routing_stats.py), so a held prefix, a queue and a batch of decodes are
weighed in one unit on any hardware, with no weights tuned per profile. A replica that learned no
model is priced in tokens (a step costs the tokens it computes), and then every replica is, so
they stay comparable.

The lowest TTFT wins, with the request's own prefill counted once more for each request already
on the replica (waiting, running, or sent since): they wait out that prefill too, a step being
shared. Without it, greedy TTFT sent a tenant away from a replica whose queue had grown; each
move cost a full prefill and a second copy of the context, and under load the fleet's hit rate
fell and its queues grew. For the same reason a prompt stays with the replica holding most of it
while that replica's cost is within one own prefill (the best replica's) of the best: a move then
buys less than the copy it makes (docs/benchmarks/fleet.md has the effect).

A new prefix (no replica holds a block of it) goes to the replica, among those whose KV pool
has room for it, where its own first token would come soonest: its predicted TTFT without the
term for the requests already there. Every replica would compute the whole prompt, so that term
would only weigh how many requests run there (on an H100, a hundred or more each), and sent every
new prompt to the replica running the fewest, however much prompt work was already queued there:
new prompts waited behind each other there. The queue, with what this router sent since the
last report, spreads a burst of new tenants between replicas instead. Replicas that price alike
(idle ones) go by the least idle cached content (free blocks still holding a prefix: what the
prompt would crowd out), so that, as Ray's PrefixCacheAffinityRouter sends a new prompt to its
smallest tenant, tenants divide between replicas and their later requests find them there."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from common.block_hash import BlockHash
from common.routing_stats import RoutingStats
from router.prefix_index import PrefixIndex
from router.pressure import BY_KV, PressureTracker

BY_PREFIX = "prefix-hit"  # fresh stats, chosen replica holds part of the prompt
BY_NEW_PREFIX = "new-prefix-home"  # nobody holds the prompt: where its first token comes soonest

# c0, c_prefill, c_decode, c_prompt_attention, c_decode_attention, c_request: a token a unit.
TOKEN_COST = (0.0, 1.0, 1.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Decision:
    ranking: list[tuple[Hashable, str]]  # replicas best first, each with the reason for its place
    overlaps: dict[Hashable, int]  # leading prompt blocks each fresh replica holds


@dataclass(frozen=True)
class _Candidate:
    replica: Hashable
    overlap: int  # blocks
    ttft_s: float  # with the term for the requests already there
    own_prefill_s: float
    own_ttft_s: float  # its own: when its first token would come
    fits: bool
    idle_cached_blocks: int
    queue_len: float

    def key(self) -> tuple[float, float]:
        return self.ttft_s, self.queue_len


def predicted_ttft(
    coefficients: Sequence[float], stats: RoutingStats, queued: int, own: int, own_start: int
) -> tuple[float, float]:
    """(TTFT, of it the request's own prefill) on a replica: `queued` prompt tokens ahead of it,
    `own` tokens of its own to compute after `own_start` cached ones."""
    c0, c_prefill, c_decode, c_prompt_attention, c_decode_attention, c_request = coefficients
    decodes = stats.num_running
    per_step = max(1, stats.max_num_batched_tokens - decodes)
    steps = max(1, math.ceil((queued + own) / per_step))
    step_s = (
        c0
        + c_decode * decodes
        + c_decode_attention * stats.num_running_context_tokens
        + c_request * (decodes + 1)
    )
    # Causal attention pairs of `own` tokens after `own_start` (as StepShape counts them).
    own_pairs = own * own_start + own * (own + 1) // 2
    own_s = c_prefill * own + c_prompt_attention * own_pairs
    return steps * step_s + c_prefill * queued + own_s, own_s


def rank_by_prefix(
    tracker: PressureTracker,
    index: PrefixIndex,
    stats: Mapping[Hashable, RoutingStats | None],
    queue_lens: Mapping[Hashable, int],
    prompt_keys: Sequence[BlockHash],
    now: float,
) -> Decision:
    """`prompt_keys`: the prompt's full blocks' keys (empty: route by load alone)."""
    by_load = tracker.rank(list(stats), stats, queue_lens, now)
    fresh = [replica for replica, reason in by_load if reason == BY_KV]
    if not prompt_keys or not fresh:
        return Decision(by_load, {})
    reports = {replica: stats[replica] for replica in fresh}
    learned = all(len(s.step_time_coefficients) == len(TOKEN_COST) for s in reports.values() if s)
    candidates = []
    for replica, load in reports.items():
        assert load is not None  # ranked by KV: it has stats
        coefficients = load.step_time_coefficients if learned else TOKEN_COST
        overlap = index.overlap(replica, prompt_keys, now)
        own_start = overlap * load.block_size
        own = max(1, len(prompt_keys) * load.block_size - own_start)
        queued = load.num_pending_prompt_tokens + tracker.in_flight_prefill_tokens(replica)
        own_ttft_s, own_s = predicted_ttft(coefficients, load, queued, own, own_start)
        # Every request already there waits out this one's prefill too: a step is shared.
        others = load.num_waiting + load.num_running + tracker.in_flight_requests(replica)
        ttft_s = own_ttft_s + own_s * others
        new_blocks = len(prompt_keys) - overlap
        in_use = tracker.pressure(replica, load, now) * load.num_total_blocks
        fits = in_use + new_blocks <= load.num_total_blocks
        queue_len = queue_lens.get(replica, math.inf)
        idle = load.num_cached_free_blocks
        candidates.append(_Candidate(replica, overlap, ttft_s, own_s, own_ttft_s, fits, idle, queue_len))
    candidates.sort(key=_Candidate.key)
    overlaps = {c.replica: c.overlap for c in candidates}
    stale = [(replica, reason) for replica, reason in by_load if reason != BY_KV]
    best = candidates[0]
    holder = max(candidates, key=lambda c: (c.overlap, -c.ttft_s))  # ties: the cheaper
    if holder is not best and holder.fits and holder.ttft_s <= best.ttft_s + best.own_prefill_s:
        candidates.remove(holder)  # it stays with its prefix: moving costs a copy for little gain
        candidates.insert(0, holder)
        best = holder
    if any(c.overlap for c in candidates) or not best.fits:
        ranked = [(c.replica, BY_PREFIX if c.overlap else BY_KV) for c in candidates]
        return Decision(ranked + stale, overlaps)
    home = min(
        (c for c in candidates if c.fits), key=lambda c: (c.own_ttft_s, c.idle_cached_blocks, c.queue_len)
    )
    ranked = [(home.replica, BY_NEW_PREFIX)] + [(c.replica, BY_KV) for c in candidates if c is not home]
    return Decision(ranked + stale, overlaps)
