"""Streamed /v1/completions load over HTTP, as a user's clients send it, paced open loop (each
request at its arrival time) or closed loop (N clients, each sending its next request when the
last one ends)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import TypeVar

import aiohttp

from bench.driver import Arrival
from common.latency import RequestTiming
from harness import pacing
from harness.sse_client import client_session, stream_completion

Send = Callable[[Arrival], Awaitable[RequestTiming]]
Sender = Callable[[str], AbstractAsyncContextManager[Send]]  # a run's cache salt -> its requests' sender
Result = TypeVar("Result")


async def stream_request(
    http: aiohttp.ClientSession, url: str, arrival: Arrival, cache_salt: str | None, model: str | None
) -> RequestTiming:
    # Greedy with exact lengths: every system under comparison does the same work. The run's own
    # cache_salt: a run never finds the prompts an earlier run (or a warm-up) left in the prefix
    # cache, as a peer with its prompt cache off would not.
    body = {"prompt": arrival.prompt, "max_tokens": arrival.max_tokens, "ignore_eos": True, "temperature": 0}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if model is not None:  # servers that route by it (Ray Serve LLM's ingress)
        body["model"] = model
    result = await stream_completion(http, url, body)
    if result.status != 200 or result.error_code is not None:
        raise RuntimeError(f"request failed: HTTP {result.status}, {result.error_code}")
    return result.timing()


TIMEOUT_S = 600


def _session() -> aiohttp.ClientSession:
    """As many connections as requests in flight: an open loop sends each request at its time, not
    when a pooled connection frees."""
    # No connection is reused: llama-server closes a kept-alive connection after a few requests, and
    # a request sent on it as it closes fails; every server under comparison pays the same connect.
    return client_session(TIMEOUT_S, connections=0, reuse_connections=False)


def _new_salt() -> str:
    return f"run-{uuid.uuid4().hex}"


async def open_loop(
    url: str, arrivals: list[Arrival], salted: bool = True, model: str | None = None
) -> tuple[float, list[RequestTiming]]:
    """Each request sent at its arrival time, whatever the server is doing. `salted`: with the
    run's own cache_salt (unsalted, a prefix-aware router may route by prefix)."""
    salt = _new_salt() if salted else None
    async with _session() as http:
        return await pacing.open_loop(
            partial(stream_request, http, url, cache_salt=salt, model=model), arrivals
        )


async def closed_loop(
    url: str, arrivals: list[Arrival], concurrency: int, model: str | None = None
) -> tuple[float, list[RequestTiming]]:
    """`concurrency` clients take the requests in order, each sending the next as its last ends."""
    salt = _new_salt()
    async with _session() as http:
        send = partial(stream_request, http, url, cache_salt=salt, model=model)
        return await pacing.closed_loop(send, arrivals, concurrency)


def http_sender(url: str, model: str | None = None) -> Sender:
    """Streamed completions to `url`, one connection a request, with the run's cache salt."""

    @asynccontextmanager
    async def sender(salt: str) -> AsyncIterator[Send]:
        async with _session() as http:
            yield partial(stream_request, http, url, cache_salt=salt, model=model)

    return sender


def run_paced(sender: Sender, paced: Callable[[Send], Awaitable[Result]]) -> Result:
    """One run (`paced`: a closed or open loop over a sender's requests), with a salt of its own."""

    async def with_sender() -> Result:
        async with sender(_new_salt()) as send:
            return await paced(send)

    return asyncio.run(with_sender())
