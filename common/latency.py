"""What a client measured of one request, and the latency summary every load reports (the real
benchmarks' and the fleet simulator's alike, so it lives below both)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class RequestTiming:
    prompt_len: int
    output_len: int
    ttft_s: float  # from when it was sent (a workload sent all at once: from the run's start)
    e2e_s: float  # from when it was sent
    token_intervals_s: list[float] = field(default_factory=list)  # where tokens were timed one by one


def summarize(wall_s: float, timings: list[RequestTiming]) -> dict[str, float]:
    ttft = [t.ttft_s for t in timings]
    e2e = [t.e2e_s for t in timings]
    intervals = [i for t in timings for i in t.token_intervals_s]
    output_tokens = sum(t.output_len for t in timings)
    summary = {
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / wall_s,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "ttft_p99_s": percentile(ttft, 0.99),
        "e2e_mean_s": statistics.fmean(e2e),
        "e2e_p50_s": percentile(e2e, 0.5),
        "e2e_p99_s": percentile(e2e, 0.99),
    }
    if intervals:  # a static batch's client sees no token before the batch ends
        summary |= {"tbt_p50_s": percentile(intervals, 0.5), "tbt_p99_s": percentile(intervals, 0.99)}
    return summary
