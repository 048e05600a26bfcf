"""What a simulation measured, in the shapes the real benchmarks report (common/latency.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from common.latency import RequestTiming, summarize
from fleet_sim.trace import SimRequest
from replica_engine.outputs import CoreOutput


@dataclass
class RequestRecord:
    request: SimRequest
    replica_id: str | None = None
    routed_s: float | None = None  # when a replica took it (after any wait at the router)
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens its replica's prefix cache held when admitted
    failed: bool = False  # its replica died while it ran

    def take(self, output: CoreOutput, now: float) -> bool:
        """Record a step's output for the request (its token's time); whether it finished."""
        self.token_times.append(now)
        if output.finished:
            self.num_cached_tokens = output.num_cached_tokens
        return output.finished

    @property
    def is_finished(self) -> bool:
        return len(self.token_times) == self.request.max_tokens

    def timing(self) -> RequestTiming:
        arrival, times = self.request.arrival_s, self.token_times
        return RequestTiming(
            prompt_len=len(self.request.prompt_token_ids),
            output_len=len(times),
            ttft_s=times[0] - arrival,
            e2e_s=times[-1] - arrival,
            token_intervals_s=[later - earlier for earlier, later in itertools.pairwise(times)],
        )


def summarize_records(records: list[RequestRecord]) -> dict[str, float]:
    """The real benchmarks' latency summary of the finished requests (wall time from the first
    arrival to the last token), with the fleet's prefix-cache hit rate (prompt tokens found
    cached / looked up) and how many failed."""
    if any(not (record.is_finished or record.failed) for record in records):
        raise ValueError("records: every request must have finished or failed")
    failed = sum(record.failed for record in records)
    records = [record for record in records if not record.failed]
    if not records:
        raise ValueError("records: no request finished")
    wall = max(r.token_times[-1] for r in records) - min(r.request.arrival_s for r in records)
    timings = [record.timing() for record in records]
    prompt_tokens = sum(t.prompt_len for t in timings)
    return summarize(wall, timings) | {
        "hit_rate": sum(r.num_cached_tokens for r in records) / prompt_tokens,
        "num_requests": len(records),
        "num_failed": failed,
    }
