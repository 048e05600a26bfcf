"""The Ingress's SameNodeRouter on stand-in replicas (Serve's RunningReplica: the router reads
only `node_id`). On a real multi-node cluster, tests/cluster/test_multinode.py loses a node and
checks that the other nodes' proxies answered every request they took."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from router.same_node import SameNodeRouter


def choose(router: SameNodeRouter, replicas: list[SimpleNamespace]) -> list[list[str]]:
    ranks = asyncio.run(router.choose_replicas(replicas))
    return [sorted(replica.name for replica in rank) for rank in ranks]


def test_a_request_goes_only_to_its_own_nodes_ingress_while_one_runs_there():
    router = SameNodeRouter(  # by keyword, as Serve builds every router
        deployment_id=DeploymentID("Ingress", "app"),
        handle_source=DeploymentHandleSource.PROXY,
        self_node_id="n2",
    )
    replicas = [SimpleNamespace(name=f"ingress-{node}", node_id=node) for node in ("n1", "n2", "n3")]
    for _ in range(10):  # never another node's, however the ties fall
        assert choose(router, replicas) == [["ingress-n2"]]
    # This node's Ingress is gone: any other node's.
    assert choose(router, [replicas[0], replicas[2]]) == [["ingress-n1", "ingress-n3"]]
    assert choose(router, []) == []
