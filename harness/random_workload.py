"""The random draws workloads are built from: token ids, log-uniform lengths, Poisson arrivals."""

from __future__ import annotations

import math
import random

RANDOM_TOKEN_RANGE = (1000, 40000)  # random prompt ids from the ordinary vocabulary


def random_tokens(rng: random.Random, n: int, token_range: tuple[int, int] = RANDOM_TOKEN_RANGE) -> list[int]:
    return [rng.randrange(*token_range) for _ in range(n)]


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of n items by rank, ~ 1 / rank^s (a few hot, most cold)."""
    return [1 / (rank + 1) ** s for rank in range(n)]


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def poisson_times(rng: random.Random, n: int, rate: float | None) -> list[float]:
    """Arrival times of a Poisson process at `rate` per second, the first one gap after 0;
    rate None: every request at 0 (a burst)."""
    if rate is None:
        return [0.0] * n
    times, now = [], 0.0
    for _ in range(n):
        now += rng.expovariate(rate)
        times.append(now)
    return times
