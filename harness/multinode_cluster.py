"""A real multi-node Ray cluster on this machine (Ray's own test tool, `ray.cluster_utils.Cluster`):
a head and worker nodes, each a raylet of its own with its own resources, object store, metrics
export port and (with proxy_location EveryNode) its own Serve proxy on its own HTTP port; then
the documented `serve run <config>` deploys onto it. With a Redis address the head's GCS keeps its
tables there (Ray's GCS fault tolerance), so the GCS can be killed and restarted under the app.

Proxies on one machine would share serve_config's HTTP port (Serve binds it with SO_REUSEPORT, so
the kernel would pick the node per connection); each worker's proxy is moved to a port of its own
with Serve's RAY_SERVE_WORKER_PROXY_HTTP_PORT, set in that node's environment, so a client picks
the node it enters through. A node is lost as a crash loses it: every process of it killed
(SIGKILL, raylet included)."""

from __future__ import annotations

import os
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.ports import free_ports
from harness.serve_cluster import (
    BIN,
    REPO,
    START_TIMEOUT_S,
    TEST_CLUSTER_ENV,
    shipped_app_config,
    wait_for_http,
    with_app_args,
)

SLOT = "stallfree_engine"  # the custom resource that pins EngineReplicas to worker nodes
WORKER_SLOTS = [{SLOT: 1}, {SLOT: 2}]  # a replica on each worker, and a spare slot on worker-2


@dataclass
class ClusterNode:
    name: str  # "head", "worker-1", ...
    node: Any  # ray._private.node.Node
    http_url: str  # this node's Serve proxy
    metrics_url: str  # this node's metrics export endpoint

    @property
    def node_id(self) -> str:
        return self.node.node_id


@dataclass
class MultiNodeCluster:
    cluster: Any  # ray.cluster_utils.Cluster
    head: ClusterNode
    workers: list[ClusterNode]
    serve_run: subprocess.Popen
    log_dir: Path
    redis_address: str | None = None  # the GCS's external store, where it has one

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def dashboard_url(self) -> str:
        """The head's dashboard (Ray's state API; Serve's REST API)."""
        return f"http://{self.cluster.webui_url}"

    def node_named(self, name: str) -> ClusterNode:
        return next(node for node in [self.head, *self.workers] if node.name == name)

    def wait_ready(self, route_prefix: str = "") -> None:
        """Until every node's proxy answers the app's /health."""
        for node in [self.head, *self.workers]:
            url = f"{node.http_url}{route_prefix}/health"
            wait_for_http(url, self.serve_run, "`serve run`", START_TIMEOUT_S, log_tail=self.serve_log_tail)

    def serve_log_tail(self) -> str:
        path = self.log_dir / "serve_run.log"
        return f"\n--- serve run's log ---\n{path.read_text()[-4000:]}" if path.exists() else ""

    def restart_gcs(self, down_s: float = 0.0) -> None:
        """Kill the head's GCS server (SIGKILL), leave it down `down_s`, start it again: it reloads
        the cluster's tables from Redis, and raylets, workers and drivers reconnect."""
        assert self.redis_address is not None, "a GCS without Redis loses the cluster when it dies"
        address = self.cluster.head_node.gcs_address
        self.cluster.head_node.kill_gcs_server()
        time.sleep(down_s)
        self.cluster.head_node.start_gcs_server()
        # Elsewhere, raylets give up after 60 s and take their nodes down (a GCS restarted on a new
        # port: the whole cluster, a minute later; so start() fixes the port).
        assert self.cluster.head_node.gcs_address == address, (address, self.cluster.head_node.gcs_address)

    def remove_worker(self, worker: ClusterNode) -> None:
        """The node dies: SIGKILL to its raylet and every other process it runs."""
        self.cluster.remove_node(worker.node, allow_graceful=False)
        self.workers.remove(worker)


@contextmanager
def _environment(values: dict[str, str]):
    """`values` in this process's environment while a node starts (its raylet inherits them, and
    the workers it forks inherit the raylet's)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start(
    config: dict,
    log_dir: Path,
    worker_resources: list[dict[str, float]],
    node_cpus: int = 2,
    redis_address: str | None = None,
) -> MultiNodeCluster:
    """A head with no custom resources (its GCS on Redis at `redis_address`, if given) and one
    worker per entry of `worker_resources`, then `serve run` of `config` (a serve_config.yaml,
    parsed) with the head's proxy on a free port."""
    from ray.cluster_utils import Cluster

    # Serve's own proxy on every node: HAProxy's stats and metrics ports are one per machine, and
    # these nodes share one.
    os.environ.update({**TEST_CLUSTER_ENV, "RAY_SERVE_ENABLE_HA_PROXY": "0"})
    # every port the cluster's servers take, distinct (drawn one by one, two could repeat)
    ports = free_ports(4 + 2 * len(worker_resources))
    head_port, metrics_port, dashboard_port, gcs_port, *worker_ports = ports
    head_args = {"num_cpus": node_cpus, "metrics_export_port": metrics_port, "dashboard_port": dashboard_port}
    if redis_address is not None:  # a restarted GCS must come back where every raylet looks for it
        head_args.update(external_addresses=[redis_address], gcs_server_port=gcs_port)
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    head = ClusterNode("head", cluster.head_node, _local(head_port), _local(metrics_port, "/metrics"))
    workers = []
    for i, resources in enumerate(worker_resources, start=1):
        http_port, metrics_port = worker_ports[2 * i - 2 : 2 * i]
        with _environment({"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(http_port)}):
            node = cluster.add_node(num_cpus=node_cpus, resources=resources, metrics_export_port=metrics_port)
        workers.append(ClusterNode(f"worker-{i}", node, _local(http_port), _local(metrics_port, "/metrics")))
    config = {**config, "proxy_location": "EveryNode"}
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": head_port}
    config_path = log_dir / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    serve_run = subprocess.Popen(
        [BIN / "serve", "run", str(config_path)],
        cwd=REPO,
        env={**os.environ, "RAY_ADDRESS": cluster.address},
        stdout=(log_dir / "serve_run.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    return MultiNodeCluster(cluster, head, workers, serve_run, log_dir, redis_address)


def start_app(app_args: dict, log_dir: Path, redis_address: str | None = None) -> MultiNodeCluster:
    """serve_config.yaml's app with `app_args` over its args on a head and the WORKER_SLOTS
    workers: each replica needs a slot (none on the head), one Ingress per node."""
    config = shipped_app_config()
    app = config["applications"][0]
    layout = {"resources": {SLOT: 1}, "ingress_replicas": 1 + len(WORKER_SLOTS)}
    app["args"] = with_app_args(app["args"], {**app_args, **layout})
    return start(config, log_dir, WORKER_SLOTS, redis_address=redis_address)


def stop(cluster: MultiNodeCluster) -> None:
    cluster.serve_run.terminate()
    try:
        cluster.serve_run.wait(timeout=60)
    except subprocess.TimeoutExpired:
        cluster.serve_run.kill()
    cluster.cluster.shutdown()


def _local(port: int, path: str = "") -> str:
    return f"http://127.0.0.1:{port}{path}"
