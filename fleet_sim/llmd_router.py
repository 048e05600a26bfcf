"""llm-d's endpoint picker with its precise prefix-cache configuration (llm-d-inference-scheduler
deploy/config/epp-precise-prefix-cache-config.yaml and the scorers under
pkg/epp/framework/plugins/scheduling/scorer/, read at 520af478, May 2026), its decision logic on
the simulator's clock:

    score = 2 x precise prefix + 1 x KV-cache utilization + 1 x queue           (weights as shipped)
    precise prefix = min(leading prompt blocks the pod holds / prompt blocks, 1)   (GPU tier: 1.0)
    KV-cache utilization = 1 - the pod's KV cache usage
    queue = (max waiting - its waiting) / (max waiting - min waiting); 1 for all when equal

The highest score wins, ties at random (max-score-picker). llm-d reads what a pod holds from
vLLM's KV events and its queue and usage from metrics scraped every 50 ms; here both are read
from the simulated replica as it is now (the freshest llm-d could be). Its decode filter keeps
every replica of a fleet that does not split prefill and decode."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from common.block_hash import adapter_root, chain_block_hashes, root_hash
from fleet_sim.replica import SimReplica
from fleet_sim.routers import Blind
from fleet_sim.trace import SimRequest


@dataclass(frozen=True)
class ScorerWeights:
    prefix: float = 2.0
    kv_cache_utilization: float = 1.0
    queue: float = 1.0


def queue_scores(waiting: Sequence[int]) -> list[float]:
    """The queue scorer: the shortest queue 1, the longest 0, linear between; all 1 when equal."""
    low, high = min(waiting), max(waiting)
    if high == low:
        return [1.0] * len(waiting)
    return [(high - q) / (high - low) for q in waiting]


def prefix_score(held_blocks: int, prompt_blocks: int) -> float:
    return min(held_blocks / prompt_blocks, 1.0) if prompt_blocks else 0.0


def total_score(weights: ScorerWeights, prefix: float, kv_cache_usage: float, queue: float) -> float:
    return (
        weights.prefix * prefix
        + weights.kv_cache_utilization * (1.0 - kv_cache_usage)
        + weights.queue * queue
    )


class LLMDPrecisePrefix(Blind):
    def __init__(self, rng: random.Random, weights: ScorerWeights = ScorerWeights()) -> None:
        self.rng = rng
        self.weights = weights

    def scores(self, request: SimRequest, replicas: Sequence[SimReplica]) -> list[float]:
        waiting = [replica.stats().num_waiting for replica in replicas]
        config = replicas[0].config  # one deployment: one model, one block size
        root = adapter_root(root_hash(config.model, request.cache_salt), request.lora_request)
        keys = chain_block_hashes(root, request.prompt_token_ids, config.block_size)
        totals = []
        for replica, queue in zip(replicas, queue_scores(waiting), strict=True):
            held = next((i for i, key in enumerate(keys) if not replica.holds_block(key)), len(keys))
            prefix = prefix_score(held, len(keys))
            totals.append(total_score(self.weights, prefix, replica.stats().kv_cache_usage, queue))
        return totals

    def rank(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> list[SimReplica]:
        shuffled = list(replicas)
        self.rng.shuffle(shuffled)  # the picker shuffles, then sorts stably: ties at random
        scored = zip(self.scores(request, shuffled), range(len(shuffled)), shuffled, strict=True)
        return [replica for _, _, replica in sorted(scored, key=lambda s: (-s[0], s[1]))]
