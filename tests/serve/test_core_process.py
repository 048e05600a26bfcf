"""The engine core's own process over HTTP on the real cluster: killed mid-stream (as the kernel's
OOM killer would), its stream ends with an error at once, the replica exits at its next health
check, and Serve replaces it."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from ray import serve

from deployments.app import AppArgs, build_app
from harness.replicas import engine_stats, kill_engine_core, wait_replaced
from harness.serve_cluster import ServeCluster, delete_app, wait_for
from harness.sse_client import client_session, stream_completion

APP = "fragile"
# SmolLM2's shape with random weights: ~20 ms steps on a core, so the 2,000 tokens stream long
# after the kill on any CPU.
LONG = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True}
HTTP_TIMEOUT_S = 300  # hang detectors only: what is checked is how the request ended
REPLACED_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def fragile_app(serve_cluster: ServeCluster) -> str:
    args = AppArgs(
        model="dummy:smollm2-135m",
        num_cpus=0,
        cpu_threads=1,
        engine={"num_kv_blocks": 160, "core_process": True},
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    url = f"{serve_cluster.base_url}/{APP}/v1/completions"
    yield url
    delete_app(APP)


def answers(url: str) -> bool:
    response = httpx.post(url, json={**LONG, "max_tokens": 2}, timeout=HTTP_TIMEOUT_S)
    return response.status_code == 200


def test_a_killed_engine_core_ends_its_stream_with_an_error_and_serve_replaces_the_replica(fragile_app: str):
    wait_for(lambda: answers(fragile_app), "the app answers")

    async def stream_and_kill_the_core() -> tuple[object, str]:
        async with client_session(HTTP_TIMEOUT_S) as http:
            stream = asyncio.create_task(stream_completion(http, fragile_app, LONG))
            await asyncio.to_thread(wait_for, lambda: engine_stats(APP).num_running == 1, "it streams")
            victim = await asyncio.to_thread(kill_engine_core, APP)
            return await stream, victim

    result, victim = asyncio.run(stream_and_kill_the_core())
    assert (result.status, result.error_code) == (200, "engine_error")
    assert result.finish_reason is None  # cut mid-stream, not run to its length
    assert wait_replaced(APP, victim, num_replicas=1, timeout_s=REPLACED_TIMEOUT_S) < math.inf
    wait_for(lambda: answers(fragile_app), "the new replica answers")
