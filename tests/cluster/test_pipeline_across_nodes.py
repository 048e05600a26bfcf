"""Pipeline stages on other nodes (`distributed_executor_backend: ray`) on Ray's multi-node test
cluster (`ray.cluster_utils.Cluster`: a head and two worker nodes, each its own raylet). The
replica is stood in for by an actor in bundle 0 of a STRICT_SPREAD placement group that captures
its children, as Serve places a replica in the group the app asks for; its engine starts one
stage worker in each further bundle, so the three sit on three nodes. Then one worker's node is
lost (every process of it SIGKILLed). Serve's replacement of a replica whose engine stopped is
tested through Serve elsewhere (tests/serve); here, that the engine stops, promptly and saying
why, instead of hanging in a collective. The model is `dummy:tiny-llama`, against itself unsplit."""

from __future__ import annotations

import time

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from harness.serve_cluster import TEST_CLUSTER_ENV
from replica_engine import LLM, SamplingParams

pytestmark = pytest.mark.own_ray_cluster
SETTINGS = {
    "model": "dummy:tiny-llama",
    "dtype": "float32",
    "num_kv_blocks": 64,
    "max_num_batched_tokens": 16,
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 40))]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
STOPPED_S = 120.0  # the engine stops after the node's loss: a hang detector, sized for 2 loaded cores


class StandInReplica:
    def __init__(self) -> None:
        self.llm = LLM(**SETTINGS, pipeline_parallel_size=2, distributed_executor_backend="ray")

    def generate(self) -> list[list[int]]:
        return [output.token_ids for output in self.llm.generate(PROMPTS, PARAMS)]

    def try_generate(self) -> str:
        """What a request after the loss meets: the error, by name and message."""
        try:
            self.llm.generate(PROMPTS, PARAMS)
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return "answered"

    def blocks_free(self) -> bool:
        manager = self.llm.engine.core.kv_cache_manager
        return manager.num_free_blocks == manager.num_blocks


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch):
    for key, value in TEST_CLUSTER_ENV.items():
        monkeypatch.setenv(key, value)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_stages_on_other_nodes_answer_as_one_model_and_a_lost_node_stops_the_engine(cluster):
    cluster, nodes = cluster
    group = placement_group([{"CPU": 1}] * 3, strategy="STRICT_SPREAD")
    ray.get(group.ready(), timeout=60)
    replica = (
        ray.remote(StandInReplica)
        .options(
            num_cpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, 0, placement_group_capture_child_tasks=True
            ),
        )
        .remote()
    )
    whole = [output.token_ids for output in LLM(**SETTINGS).generate(PROMPTS, PARAMS)]
    assert ray.get(replica.generate.remote(), timeout=STOPPED_S) == whole
    # The replica and each stage on a node of its own.
    bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
    assert len(set(bundle_nodes.values())) == 3
    lost = next(node for node in nodes if node.node_id in {bundle_nodes[1], bundle_nodes[2]})
    assert lost.node_id != bundle_nodes[0]
    cluster.remove_node(lost, allow_graceful=False)
    started = time.monotonic()
    outcome = ray.get(replica.try_generate.remote(), timeout=STOPPED_S)  # the step in flight fails
    print(f"after the loss, in {time.monotonic() - started:.1f} s: {outcome}")
    assert outcome != "answered"
    # Every later request fails at once, naming the worker; the failed ones hold no KV block.
    outcome = ray.get(replica.try_generate.remote(), timeout=30)
    assert outcome.startswith("WorkerDiedError: parallel worker") and "Ray actor died" in outcome, outcome
    assert ray.get(replica.blocks_free.remote(), timeout=30)
