"""Limits over HTTP on the real cluster: KV exhaustion, a request that can never fit, and
request_timeout_s."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from ray import serve

from common.finish_reason import FinishReason
from deployments.app import AppArgs, build_app
from harness.metrics_scrape import ENGINE_PREFIX, scrape
from harness.replicas import engine_stats
from harness.serve_cluster import ServeCluster, delete_app, wait_for
from harness.sse_client import client_session, stream_completion
from replica_engine import LLM, SamplingParams
from replica_engine.metrics.engine_metrics import REASON_LABEL
from tests.engine.engine_idle import wait_idle

SMALL_APP = {"application": "small", "deployment": "EngineReplica"}


def test_kv_exhaustion_preempts_and_recomputes_without_changing_greedy_output(
    serve_cluster: ServeCluster, small_app: str, llm: LLM
):
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    expected = llm.generate("Count to ten.", params)[0].outputs[0].text  # offline, a pool with room to spare
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


# SmolLM2's shape with random weights: a step takes ~20 ms on a core, so LONG's first token comes
# within a fraction of REQUEST_TIMEOUT_S however loaded the machine, and its 2,000 tokens take far
# longer than it on any CPU (tiny-llama's ~1 ms steps left a loaded machine too little margin).
LONG = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True}
REQUEST_TIMEOUT_S = 3.0
HTTP_TIMEOUT_S = 300  # a hang detector only: what is checked is how the request ended
TIMEOUT_APP = {"application": "timeout"}
ABORTED = f"{ENGINE_PREFIX}requests_finished_total"


@pytest.fixture(scope="module")
def timeout_app(serve_cluster: ServeCluster) -> str:
    """One replica whose requests may take at most REQUEST_TIMEOUT_S."""
    args = AppArgs(
        model="dummy:smollm2-135m",
        num_cpus=0,
        cpu_threads=1,
        request_timeout_s=REQUEST_TIMEOUT_S,
        engine={"num_kv_blocks": 160},
    )
    serve.run(build_app(args), name="timeout", route_prefix="/timeout")
    url = f"{serve_cluster.base_url}/timeout"
    # A new app's first request also waits for its handle to learn the replicas.
    wait_for(
        lambda: (
            httpx.post(
                f"{url}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=HTTP_TIMEOUT_S
            ).status_code
            == 200
        ),
        "the timeout app answers",
    )
    yield url
    delete_app("timeout")


def _aborts(cluster: ServeCluster) -> float:
    return scrape(cluster, ABORTED, {**TIMEOUT_APP, REASON_LABEL: FinishReason.ABORT.value})


def assert_aborted_and_freed(cluster: ServeCluster, aborts_before: float) -> None:
    """The engine ended the request as aborted (not run on to its length) and holds nothing."""
    wait_for(lambda: _aborts(cluster) == aborts_before + 1, "the timed-out request is counted as aborted")
    wait_idle(lambda: engine_stats("timeout"))


def test_request_timeout_answers_408_and_frees_the_request(serve_cluster: ServeCluster, timeout_app: str):
    short = httpx.post(
        f"{timeout_app}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=HTTP_TIMEOUT_S
    )
    assert short.status_code == 200, short.text
    before = _aborts(serve_cluster)
    response = httpx.post(f"{timeout_app}/v1/completions", json=LONG, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 408, response.text
    assert response.json()["error"]["code"] == "request_timeout"
    assert_aborted_and_freed(serve_cluster, before)


def test_request_timeout_ends_a_stream_with_an_error_event(serve_cluster: ServeCluster, timeout_app: str):
    async def stream():
        async with client_session(HTTP_TIMEOUT_S) as http:
            return await stream_completion(http, f"{timeout_app}/v1/completions", LONG)

    before = _aborts(serve_cluster)
    result = asyncio.run(stream())
    assert (result.status, result.error_code) == (200, "request_timeout")
    assert result.chunk_times and result.finish_reason is None  # cut mid-stream, not at its length
    assert_aborted_and_freed(serve_cluster, before)
