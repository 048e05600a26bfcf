"""Prefill/decode disaggregation across nodes of Ray's multi-node test cluster
(harness/multinode_cluster.py): the PrefillReplica on worker-1, the DecodeReplica on worker-2 (each
pinned by a custom resource), serve_config.yaml's app deployed by `serve run`. Blocks cross nodes
over TCP (`kv_connector: auto`: the nodes' ids differ). Greedy answers equal the offline engine's
(colocated), clients hanging up mid-way included; then the prefill node is lost (every process of
it SIGKILLed) under load: every request still gets its right answer (the decode replica computes
what it cannot fetch), and the decode replica holds nothing once idle. `dummy:tiny-llama`, fp32."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from harness import metrics_scrape, multinode_cluster, soak_load
from harness.multinode_cluster import MultiNodeCluster
from harness.serve_cluster import shipped_app_config, wait_for, with_app_args
from replica_engine.metrics.engine_metrics import OUTCOME_LABEL

pytestmark = pytest.mark.own_ray_cluster
APP = "stallfree"
MODEL = "dummy:tiny-llama"
PREFILL_SLOT, DECODE_SLOT = "pd_prefill", "pd_decode"
APP_ARGS = {
    "model": MODEL,
    "num_cpus": 0,
    "cpu_threads": 1,
    # One Ingress per node, each proxy's own: the lost node takes only its own with it (a single
    # Ingress placed there took every later request's answer with it, a 503 from the head's proxy).
    "ingress_replicas": 3,
    "engine": {"num_kv_blocks": 256, "dtype": "float32"},
    "disaggregation": {
        "prefill_timeout_s": 10,
        "prefill": {"resources": {PREFILL_SLOT: 1}},
        "decode": {"resources": {DECODE_SLOT: 1}},
    },
}
REQUEST_S = 300.0  # a hang detector for one batch, sized for 2 loaded cores
LOSE_AFTER_S = 2.0  # pacing: requests are on their way when the node goes


def requests(seed: int, num_requests: int) -> list[soak_load.SoakRequest]:
    workload = soak_load.soak_workload(
        num_requests, 512, 0.25, seed=seed, prompt_range=(40, 400), output_range=(8, 16)
    )
    return soak_load.with_expected_outputs(workload, MODEL)  # greedy, offline: colocated


def outcomes(cluster: MultiNodeCluster, batch: list[soak_load.SoakRequest]) -> list[str]:
    url = f"{cluster.head.http_url}/v1/completions"
    _, results = asyncio.run(asyncio.wait_for(soak_load.run_load(url, batch, concurrency=4), REQUEST_S))
    return [soak_load.outcome(r, res) for r, res in zip(batch, results, strict=True)]


@pytest.fixture
def cluster(tmp_path):
    config = shipped_app_config()
    app = config["applications"][0]
    app["args"] = with_app_args(app["args"], APP_ARGS)
    cluster = multinode_cluster.start(config, tmp_path, [{PREFILL_SLOT: 1}, {DECODE_SLOT: 1}])
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        multinode_cluster.stop(cluster)


def test_blocks_cross_nodes_and_a_lost_prefill_node_loses_no_request(cluster):
    prefill_node, decode_node = cluster.workers

    def transfers(outcome: str) -> float:
        name = f"{metrics_scrape.ENGINE_PREFIX}kv_transfers_total"
        return metrics_scrape.scrape(decode_node, name, {"application": APP, OUTCOME_LABEL: outcome})

    first = outcomes(cluster, requests(seed=1, num_requests=8))
    assert set(first) <= {"completed", "disconnected"} and "completed" in first, first
    wait_for(lambda: transfers("received") >= 1, "blocks received over TCP from the other node")

    # The prefill node goes while a batch is on its way: prefills in flight fail, published
    # blocks cannot be fetched, later prefills find no replica (prefill_timeout_s): the decode
    # replica computes those prompts, and every answer is still the model's.
    batch, found = requests(seed=2, num_requests=12), []
    loader = threading.Thread(target=lambda: found.extend(outcomes(cluster, batch)))
    loader.start()
    loader.join(LOSE_AFTER_S)
    cluster.remove_worker(prefill_node)
    loader.join(REQUEST_S)
    assert not loader.is_alive(), "a request hung after the prefill node was lost"
    assert set(found) <= {"completed", "disconnected"}, found
    after = outcomes(cluster, requests(seed=3, num_requests=4))
    assert set(after) <= {"completed", "disconnected"}, after
    drain_s, held = metrics_scrape.wait_drained(decode_node, APP)
    assert math.isfinite(drain_s), held
    print(f"outcomes {sorted(found)}; blocks received {transfers('received')}, lost {transfers('lost')}")
