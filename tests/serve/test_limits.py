"""Limits over HTTP on the real cluster: KV exhaustion, a request that can never fit, and
request_timeout_s."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from ray import serve

from deployments.app import AppArgs, build_app
from harness.metrics_scrape import scrape
from harness.serve_cluster import ServeCluster, wait_for
from harness.sse_client import stream_completion
from replica_engine import LLM, EngineStats, SamplingParams
from tests.engine.engine_idle import wait_idle

SMALL_APP = {"application": "small", "deployment": "EngineReplica"}


def test_kv_exhaustion_preempts_and_recomputes_without_changing_greedy_output(
    serve_cluster: ServeCluster, small_app: str, llm: LLM
):
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    expected = llm.generate("Count to ten.", params)[0].text  # offline, a pool with room to spare
    before = scrape(serve_cluster, "ray_stallfree_num_preemptions_total", SMALL_APP)
    # Four choices of ~54 tokens need 16 blocks; the small app's pool has 8.
    body = {"prompt": "Count to ten.", "max_tokens": 50, "n": 4, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{small_app}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    assert [choice["text"] for choice in response.json()["choices"]] == [expected] * 4
    wait_for(
        lambda: scrape(serve_cluster, "ray_stallfree_num_preemptions_total", SMALL_APP) > before,
        "the engine preempted",
    )


def test_a_request_larger_than_the_whole_kv_pool_gets_400_up_front(small_app: str):
    # 150 tokens fit the 160-token context but need 10 blocks of a pool of 8: it could never run.
    body = {"prompt": [1] * 100, "max_tokens": 50}
    response = httpx.post(f"{small_app}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "whole KV pool" in error["message"]


LONG = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True}  # ~2 s of decoding


@pytest.fixture(scope="module")
def timeout_app(serve_cluster: ServeCluster) -> str:
    """One tiny-llama replica whose requests may take at most 0.5 s (LONG takes ~2 s: ~1 ms a step)."""
    args = AppArgs(model="dummy:tiny-llama", num_cpus=0, cpu_threads=1, request_timeout_s=0.5)
    serve.run(build_app(args), name="timeout", route_prefix="/timeout")
    url = f"{serve_cluster.base_url}/timeout"
    # Warm up: a new app's first request also waits for its handle to learn the replicas.
    for _ in range(10):
        if httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2}).status_code == 200:
            break
    yield url
    serve.delete("timeout")


def _stats() -> EngineStats:
    return serve.get_deployment_handle("EngineReplica", app_name="timeout").stats.remote().result()


def test_request_timeout_answers_408_and_frees_the_request(timeout_app: str):
    short = httpx.post(f"{timeout_app}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=60)
    assert short.status_code == 200, short.text
    started = time.monotonic()
    response = httpx.post(f"{timeout_app}/v1/completions", json=LONG, timeout=60)
    assert response.status_code == 408, response.text
    assert response.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 5
    wait_idle(_stats, timeout_s=2)


def test_request_timeout_ends_a_stream_with_an_error_event(timeout_app: str):
    async def stream():
        async with httpx.AsyncClient(timeout=60) as http:
            return await stream_completion(http, f"{timeout_app}/v1/completions", LONG)

    result = asyncio.run(stream())
    assert (result.status, result.error_code) == (200, "request_timeout")
    assert result.chunk_times and result.done_at - result.sent_at < 5
    wait_idle(_stats, timeout_s=2)
