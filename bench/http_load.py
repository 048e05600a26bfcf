"""Streamed /v1/completions load over HTTP, as a user's clients send it: open loop (each request
at its arrival time) or closed loop (N clients, each sending its next request when the last one
ends), and the latency summary every serving benchmark reports."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import httpx

from bench.sse_client import stream_completion
from bench.workload import percentile


@dataclass(frozen=True)
class Arrival:
    at_s: float  # from the run's start; closed loops ignore it
    prompt: list[int]
    max_tokens: int


@dataclass
class StreamTiming:
    prompt_len: int
    output_len: int
    ttft_s: float  # from when it was sent
    e2e_s: float
    token_intervals_s: list[float]


async def _stream(
    http: httpx.AsyncClient, url: str, arrival: Arrival, cache_salt: str | None
) -> StreamTiming:
    # Greedy with exact lengths: every system under comparison does the same work. The run's own
    # cache_salt: a run never finds the prompts an earlier run (or a warm-up) left in the prefix
    # cache, as a peer with its prompt cache off would not.
    body = {"prompt": arrival.prompt, "max_tokens": arrival.max_tokens, "ignore_eos": True, "temperature": 0}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    result = await stream_completion(http, url, body)
    if result.status != 200 or result.error_code is not None:
        raise RuntimeError(f"request failed: HTTP {result.status}, {result.error_code}")
    return StreamTiming(
        len(arrival.prompt),
        result.completion_tokens,
        result.ttft_s,
        result.done_at - result.sent_at,
        result.chunk_gaps_s,
    )


def _new_salt() -> str:
    return f"run-{uuid.uuid4().hex}"


async def open_loop(
    url: str, arrivals: list[Arrival], salted: bool = True
) -> tuple[float, list[StreamTiming]]:
    """Each request sent at its arrival time, whatever the server is doing. `salted`: with the
    run's own cache_salt (unsalted, a prefix-aware router may route by prefix)."""
    salt = _new_salt() if salted else None

    async def at_its_time(http: httpx.AsyncClient, arrival: Arrival, start: float) -> StreamTiming:
        await asyncio.sleep(max(0.0, start + arrival.at_s - time.monotonic()))
        return await _stream(http, url, arrival, salt)

    async with httpx.AsyncClient(timeout=600) as http:
        start = time.monotonic()
        timings = await asyncio.gather(*(at_its_time(http, a, start) for a in arrivals))
        return time.monotonic() - start, list(timings)


async def closed_loop(
    url: str, arrivals: list[Arrival], concurrency: int
) -> tuple[float, list[StreamTiming]]:
    """`concurrency` clients take the requests in order, each sending the next as its last ends."""
    pending = list(reversed(arrivals))
    timings: list[StreamTiming] = []
    salt = _new_salt()

    async def client(http: httpx.AsyncClient) -> None:
        while pending:
            timings.append(await _stream(http, url, pending.pop(), salt))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return time.monotonic() - start, timings


def summarize(wall_s: float, timings: list[StreamTiming]) -> dict[str, float]:
    ttft = [t.ttft_s for t in timings]
    intervals = [i for t in timings for i in t.token_intervals_s]
    return {
        "wall_s": wall_s,
        "output_tok_per_s": sum(t.output_len for t in timings) / wall_s,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tbt_p50_s": percentile(intervals, 0.5),
        "tbt_p99_s": percentile(intervals, 0.99),
        "e2e_p99_s": percentile([t.e2e_s for t in timings], 0.99),
    }
