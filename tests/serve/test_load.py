"""Load with disconnects, on the real Ray cluster: the whole serving path (HTTP, Ingress, router,
two replicas, scheduler, KV cache, streaming, cancellation) under 1,000 requests at concurrency
64. The replicas run `dummy:tiny-llama`, a 2-layer random-weight Llama: on 2 CPU cores the real
SmolLM2 would need ~16 minutes for this workload (`python -m bench soak` runs it), and the model's
math is not what this test is about. Shares its workload, client and report (harness.soak_load)
with that benchmark."""

from __future__ import annotations

import asyncio
import math

import pytest
from ray import serve

from deployments.app import AppArgs, build_app
from harness import soak_load
from harness.metrics_scrape import EngineCounters, wait_drained
from harness.serve_cluster import ServeCluster, delete_app, wait_for

APP = "load"


@pytest.fixture(scope="module")
def load_app(serve_cluster: ServeCluster) -> str:
    """Two replicas of 256 KV blocks (4,096 tokens) each: 32 requests of up to 640 tokens on a
    replica sometimes need more, so the engines preempt under this load."""
    args = AppArgs(
        model="dummy:tiny-llama",
        num_replicas=2,
        num_cpus=0,
        cpu_threads=1,
        engine={"num_kv_blocks": 256, "max_num_seqs": 64, "dtype": "float32"},
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield f"{serve_cluster.base_url}/{APP}/v1/completions"
    delete_app(APP)


def test_a_thousand_requests_with_disconnects_lose_nothing_and_leak_nothing(
    serve_cluster: ServeCluster, load_app: str
):
    workload = soak_load.soak_workload(1000, vocab_size=512, disconnect_fraction=0.1, seed=7)
    requests = soak_load.with_expected_outputs(workload, "dummy:tiny-llama")  # greedy, offline
    before = EngineCounters.scrape(serve_cluster, APP)
    wall_s, results = asyncio.run(soak_load.run_load(load_app, requests, concurrency=64))
    report = soak_load.client_report(requests, results, wall_s)
    print(report)
    outcomes = report["outcomes"]
    # Every client that stayed got exactly its greedy output, and every one that hung up a prefix
    # of it (the offline engine's tokens); nothing failed.
    assert set(outcomes) <= {"completed", "disconnected"}, outcomes
    assert outcomes["disconnected"] >= report["disconnects_planned"] // 2, outcomes

    def finished() -> dict[str, float]:
        return EngineCounters.scrape(serve_cluster, APP).since(before).finished_by_reason

    # Every request reached an end in an engine: run to its length, or aborted on hang-up.
    wait_for(
        lambda: finished()["length"] + finished()["abort"] == len(requests),
        "every request is counted as finished",
    )
    delta = EngineCounters.scrape(serve_cluster, APP).since(before)
    assert 0 < delta.finished_by_reason["abort"] <= outcomes["disconnected"], delta
    assert delta.finished_by_reason["error"] == 0 and delta.preemptions > 0, delta
    drain_s, held = wait_drained(serve_cluster, APP)
    # no request still running, no block held (inf: not drained within DRAIN_TIMEOUT_S, a deadline on state)
    assert math.isfinite(drain_s), held
