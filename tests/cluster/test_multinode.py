"""A real multi-node Ray cluster on this machine (harness/multinode_cluster.py: Ray's own
`cluster_utils.Cluster`): a head and two worker nodes, each its own raylet, object store, metrics
port and Serve proxy (proxy_location EveryNode), the head's GCS on a real Redis (Debian's
redis-server; Ray's GCS fault tolerance). The app is serve_config.yaml's, deployed by
`serve run`, with its args pinning one EngineReplica to each worker by a custom resource (worker-2
offers a second slot, where Serve can put a replacement) and one Ingress (with its routers) per
node. The replicas run `dummy:tiny-llama`: what is tested is where requests go, not the model."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from harness import metrics_scrape, multinode_cluster, redis_server, soak_load
from harness.debian_package import find_or_install
from harness.metrics_scrape import EngineCounters, MetricsPage, settled, wait_drained
from harness.multinode_cluster import ClusterNode, MultiNodeCluster
from harness.serve_cluster import wait_for
from harness.sse_client import StreamResult
from router.kv_router import ROUTED_METRIC
from router.prefix_policy import BY_NEW_PREFIX, BY_PREFIX
from router.pressure import BY_KV
from tests.serve import prometheus_server

pytestmark = pytest.mark.own_ray_cluster
APP = "stallfree"
APP_ARGS = {  # over serve_config.yaml's; multinode_cluster.start_app adds the placement
    "model": "dummy:tiny-llama",
    "num_replicas": 2,
    "num_cpus": 0,
    "cpu_threads": 1,
    "engine": {"num_kv_blocks": 256, "dtype": "float32"},
}
LOSE_AFTER_S = 4.0  # pacing: streams are flowing when the node goes (nothing is timed against it)
# Deadlines on state (hang detectors), sized for a 2-core machine under full load. On an idle one
# (README's "When things go wrong"): Ray declared the lost node dead after ~13 s, every client had
# its answer soon after, and the replacement ran within a minute.
ALL_ENDED_S = 300.0  # after the loss, every client has its answer (or its error)
DECLARED_DEAD_S = 300.0  # Ray's state API shows the lost replica dead
REPLACED_S = 300.0
# Serve's controller drops a dead replica and broadcasts the change to every router; that last hop
# cannot be read from outside, so the probes wait this long after the replica is seen dead.
BROADCAST_S = 5.0
NUM_PROBES = 6
# A chat user's next turn comes seconds after the answer. A router learns of blocks another node's
# router placed only from the replica's next report (every 0.5 s, then Serve's broadcast): turns
# sent back to back through different nodes' proxies missed the cache (measured: 0.5 s apart, 1
# of 3 missed; 1 s apart, none alone, but one of a full make test's runs on a busy host missed:
# a report every 0.5 s, then the controller's loop of 0.5 s, then the router's own processing).
TURN_GAP_S = 2.0
GCS_DOWN_S = 5.0  # the GCS is killed, left down this long, then started again


@functools.cache
def redis_binary() -> tuple[str | None, str]:
    return find_or_install("redis-server", "redis-server")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("multinode")
    with ExitStack() as stack:
        binary, _ = redis_binary()  # without it, only the GCS test skips
        redis = stack.enter_context(redis_server.running(binary, log_dir)) if binary else None
        cluster = multinode_cluster.start_app(APP_ARGS, log_dir, redis_address=redis)
        try:
            cluster.wait_ready()
            yield cluster  # no Ray driver here: Ray's state API through the dashboard, and the metrics
        finally:
            multinode_cluster.stop(cluster)


def replicas_reporting(nodes: list[ClusterNode]) -> set[str]:
    """What the engines on these nodes report (across a GCS restart too)."""
    return {replica for node in nodes for replica in metrics_scrape.replicas_reporting(node, APP)}


def nodes_running(cluster: MultiNodeCluster, class_name: str) -> list[str]:
    """The node of every live actor of this class (Serve's replicas: ServeReplica:<app>:<name>),
    from Ray's state API on the head's dashboard."""
    from ray.util.state import list_actors

    actors = list_actors(cluster.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)
    return sorted(a.node_id for a in actors if a.class_name.split(":")[-1] == class_name)


def routed_by(node: ClusterNode, label: str) -> Counter[str]:
    """Requests the routers on this node have routed, by `reason` or by `target_replica` (from the
    node's own metrics port)."""
    routed: Counter[str] = Counter()
    for sample in MetricsPage(node).samples:
        if sample.name == f"ray_{ROUTED_METRIC}_total" and sample.labels.get("application") == APP:
            routed[sample.labels[label]] += int(sample.value)
    return routed


def routed_reasons(node: ClusterNode) -> Counter[str]:
    return routed_by(node, "reason")


def test_replicas_spread_over_nodes_and_every_nodes_router_finds_a_conversations_prefix(
    cluster: MultiNodeCluster,
):
    nodes = [cluster.head, *cluster.workers]
    assert nodes_running(cluster, "EngineReplica") == sorted(w.node_id for w in cluster.workers)
    assert (
        nodes_running(cluster, "Ingress")
        == nodes_running(cluster, "ProxyActor")
        == sorted(n.node_id for n in nodes)
    )
    model = openai.OpenAI(base_url=f"{cluster.head.http_url}/v1", api_key="unused").models.list().data[0].id
    for node in nodes:  # a router starts with its Ingress's first request, before any report reached it
        openai.OpenAI(base_url=f"{node.http_url}/v1", api_key="unused").completions.create(
            model=model, prompt=[1, 2, 3], max_tokens=1
        )
    before = {node.name: settled(lambda node=node: routed_reasons(node)) for node in nodes}
    system = [i % 400 + 50 for i in range(300)]  # token ids: the model (vocab 512) has no tokenizer
    for conversation in range(3):
        prompt, last_prompt_tokens = system, 0
        for turn in range(3):  # each turn enters through the next node's proxy
            node = nodes[(conversation + turn) % len(nodes)]
            client = openai.OpenAI(base_url=f"{node.http_url}/v1", api_key="unused")
            prompt = prompt + [460 + conversation, 470 + turn] * 10  # the user's next question
            completion = client.completions.create(
                model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
            )
            usage = completion.usage
            if turn:  # the conversation so far is a prefix of this prompt: all but its last block cached
                cached = usage.prompt_tokens_details.cached_tokens
                assert cached >= last_prompt_tokens - 16, (conversation, turn, node.name, cached)
            last_prompt_tokens = usage.prompt_tokens
            prompt = prompt + completion.choices[0].token_ids  # the answer, resent with the next turn
            time.sleep(TURN_GAP_S)

    # Each node's own routers routed its requests (the proxy kept them on its node), all on fresh
    # stats from both replicas: none by queue length for want of a report.
    def routed_since(node: ClusterNode) -> Counter[str]:
        return routed_reasons(node) - before[node.name]

    wait_for(lambda: all(routed_since(node).total() >= 3 for node in nodes), "every node's routing counted")
    for node in nodes:
        routed = routed_since(node)
        assert routed.total() == 3 and set(routed) <= {BY_PREFIX, BY_NEW_PREFIX, BY_KV}, (node.name, routed)


Answers = list[tuple[str, int]]  # (node, HTTP status; 0: no HTTP answer)


async def ask_every_node(nodes: list[ClusterNode]) -> Answers:
    """One short completion through each node's proxy: (node, status)."""
    async with httpx.AsyncClient(timeout=60) as http:
        return [(node.name, await short_completion(http, node.http_url)) for node in nodes]


async def short_completion(http: httpx.AsyncClient, base_url: str) -> int:
    """Its HTTP status; 0 where no HTTP answer came."""
    body = {"prompt": [7] * 20, "max_tokens": 2}
    try:
        return (await http.post(f"{base_url}/v1/completions", json=body)).status_code
    except httpx.HTTPError:
        return 0


def test_prometheus_finds_every_node_and_the_dashboard_shows_each_nodes_replicas(
    cluster: MultiNodeCluster, tmp_path: Path
):
    binary, why_not = find_or_install("prometheus", "prometheus")
    if binary is None:
        pytest.skip(why_not)
    nodes = [cluster.head, *cluster.workers]
    process, url = prometheus_server.start(binary, tmp_path)  # with dashboards/prometheus.yml
    try:
        # Ray's service-discovery file names every node's export port; Prometheus scrapes each.
        ports = {httpx.URL(node.metrics_url).port for node in nodes}

        def scraped() -> set[int | None]:
            up = prometheus_server.query(url, "up == 1")
            return {httpx.URL(f"http://{r['metric']['instance']}").port for r in up}

        wait_for(lambda: ports <= scraped(), f"Prometheus scrapes every node's metrics port {ports}")
        # Every panel's query returns data, except those of features off by default, which say so.
        queries = prometheus_server.dashboard_queries(with_optional=False)
        empty = prometheus_server.unanswered(url, queries)
        scraped_targets = prometheus_server.targets(url)
        assert not empty, (
            f"dashboard queries that return nothing: {json.dumps(empty, indent=1)}\n"
            f"Prometheus's targets: {json.dumps(scraped_targets, indent=1)}"
        )
        # The per-replica panels show the replicas of every node (each once Prometheus has scraped
        # its series twice: rate() needs two samples).
        replicas = replicas_reporting(cluster.workers)
        assert len(replicas) == len(cluster.workers)
        per_replica = {key: expr for key, expr in queries.items() if "by (replica)" in expr}

        def unshown() -> dict[str, set[str]]:
            shown = {
                key: {result["metric"]["replica"] for result in prometheus_server.query(url, expr)}
                for key, expr in per_replica.items()
            }
            return {key: replicas - keys for key, keys in shown.items() if replicas - keys}

        wait_for(lambda: not unshown(), f"every per-replica panel shows every replica {replicas}")
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_node_lost_mid_stream_fails_only_its_requests_and_serve_replaces_its_replica(
    cluster: MultiNodeCluster,
):
    lost, survivor = cluster.node_named("worker-1"), cluster.node_named("worker-2")
    entries = [cluster.head, survivor, lost]
    workload = soak_load.soak_workload(60, 512, 0.0, seed=3, prompt_range=(8, 200), output_range=(40, 120))
    requests = soak_load.with_expected_outputs(workload, "dummy:tiny-llama")  # greedy, offline
    shares = [requests[i :: len(entries)] for i in range(len(entries))]

    lost_replicas = replicas_reporting([lost])
    assert lost_replicas, f"{lost.name} reports no replica"

    async def serve_and_lose() -> list[list[StreamResult]]:
        loads = [
            asyncio.create_task(soak_load.run_load(f"{node.http_url}/v1/completions", share, concurrency=6))
            for node, share in zip(entries, shares, strict=True)
        ]
        await asyncio.sleep(LOSE_AFTER_S)
        await asyncio.to_thread(cluster.remove_worker, lost)
        _, pending = await asyncio.wait(loads, timeout=ALL_ENDED_S)
        assert not pending, f"clients still waiting {ALL_ENDED_S} s after the node was lost"
        return [task.result()[1] for task in loads]

    results = asyncio.run(serve_and_lose())
    outcomes = {
        node.name: Counter(soak_load.outcome(r, res) for r, res in zip(share, node_results, strict=True))
        for node, share, node_results in zip(entries, shares, results, strict=True)
    }
    print(outcomes)
    # Through the surviving nodes' proxies: exactly the greedy tokens, or 503 replica_failed for
    # the requests the lost replica held (the status, or the error event mid-stream).
    for name in ("head", "worker-2"):
        assert set(outcomes[name]) <= {"completed", "failed:replica_failed"}, outcomes
        assert outcomes[name]["completed"] >= len(shares[0]) // 2, outcomes
    # Through the lost node's own proxy: its connections close with it, or, where its Ingress hears
    # of its replica's end before its own (over gRPC the hop fails at once), a 503 replica_failed.
    answered = ("completed", "failed:replica_failed")
    assert all(o in answered or o.startswith("failed:client:") for o in outcomes["worker-1"]), outcomes
    # Once Ray has declared the node dead, the routers stop choosing its replica: every probe is
    # answered, and none is routed there.
    deadline = time.monotonic() + DECLARED_DEAD_S
    while lost.node_id in nodes_running(cluster, "EngineReplica"):
        assert time.monotonic() < deadline, f"the lost replica still alive {DECLARED_DEAD_S} s on"
        time.sleep(1)
    time.sleep(BROADCAST_S)
    routed_before = routed_by(cluster.head, "target_replica")
    statuses = asyncio.run(probe(cluster.head.http_url))
    assert statuses == [200] * NUM_PROBES, statuses
    wait_for(
        lambda: routed_by(cluster.head, "target_replica").total() >= routed_before.total() + NUM_PROBES,
        "the probes' routing counted",
    )
    routed = routed_by(cluster.head, "target_replica") - routed_before
    assert not set(routed) & lost_replicas, (routed, lost_replicas)
    # Serve replaces it on the node that offers a slot; afterwards nothing is held.
    deadline = time.monotonic() + REPLACED_S
    while len(replicas_reporting([survivor])) < 2:
        assert time.monotonic() < deadline, f"no replacement on {survivor.name} in {REPLACED_S} s"
        time.sleep(1)
    drain_s, held = wait_drained(survivor, APP)  # both replicas are there now
    assert math.isfinite(drain_s) and len(held) == 2, held  # inf: not drained within its deadline


def test_the_gcs_restarts_under_the_app_and_nothing_is_lost_or_restarted(cluster: MultiNodeCluster):
    if cluster.redis_address is None:
        pytest.skip(
            f"no Redis for the GCS's tables: {redis_binary()[1]} (Debian: apt-get install redis-server)"
        )
    nodes = [cluster.head, *cluster.workers]
    replicas = replicas_reporting(cluster.workers)
    workload = soak_load.soak_workload(30, 512, 0.0, seed=4, prompt_range=(8, 100), output_range=(60, 120))
    requests = soak_load.with_expected_outputs(workload, "dummy:tiny-llama")

    async def serve_through_a_restart() -> tuple[list[StreamResult], Answers, Answers]:
        load = asyncio.create_task(soak_load.run_load(f"{cluster.head.http_url}/v1/completions", requests, 6))
        await asyncio.sleep(2)  # streams are flowing
        restart = asyncio.create_task(asyncio.to_thread(cluster.restart_gcs, GCS_DOWN_S))
        during = []
        while not restart.done():  # requests sent while the GCS is down or loading, through every node
            during += await ask_every_node(nodes)
            await asyncio.sleep(0.5)
        await restart
        after = await ask_every_node(nodes)
        return (await load)[1], during, after

    results, during, after = asyncio.run(serve_through_a_restart())
    outcomes = Counter(soak_load.outcome(r, res) for r, res in zip(requests, results, strict=True))
    # Serving never needed the GCS: every stream exact, every request answered.
    assert outcomes == {"completed": len(requests)}, outcomes
    assert during and all(status == 200 for _, status in during + after), (during, after)

    # Metrics resume: the engines' counters, on their nodes' export ports, count requests sent now.
    def finished_on_workers() -> float:
        return sum(sum(EngineCounters.scrape(w, APP).finished_by_reason.values()) for w in cluster.workers)

    before = finished_on_workers()
    asyncio.run(ask_every_node(nodes))
    wait_for(lambda: finished_on_workers() >= before + len(nodes), "engine counters after the GCS restart")
    # No replica was restarted: the same replicas report, none new.
    assert replicas_reporting(cluster.workers) == replicas


async def probe(url: str) -> list[int]:
    """NUM_PROBES short requests, one after another: their HTTP statuses (0: no HTTP answer)."""
    async with httpx.AsyncClient(timeout=ALL_ENDED_S) as http:
        return [await short_completion(http, url) for _ in range(NUM_PROBES)]
