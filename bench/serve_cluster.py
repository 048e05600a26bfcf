"""A real local Ray cluster running `serve run <config>`, for the end-to-end tests and benchmarks.

The cluster is started with `ray start --head` (so the tests' own driver can attach to it for
replica stats), then the documented `serve run` deploys the repository's serve_config.yaml onto
it, with only the HTTP port moved to a free one."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from replica_engine.metrics import EngineMetrics

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 300
REPORT_WAIT_S = 20  # Ray's workers report metrics every second in the test cluster; leave slack


def engine_as_served(
    engine_settings: dict | None = None, metrics: EngineMetrics | None = None, num_threads: int | None = None
):
    """An AsyncEngine in this process, built as serve_config.yaml's app builds its replica's
    (`engine_settings` over the shipped ones, every core for torch unless `num_threads`): the
    engine without Ray."""
    import torch

    from deployments.app import AppArgs
    from replica_engine import AsyncEngine

    base = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"][0]["args"]
    settings = {**base, "engine": {**base["engine"], **(engine_settings or {})}}
    torch.set_num_threads(num_threads or len(os.sched_getaffinity(0)))  # as the replica sets it
    return AsyncEngine(AppArgs.model_validate(settings).engine_config(), metrics)


def config_with_apps(path: Path, app_args: dict[str, dict]) -> Path:
    """serve_config.yaml with its app once per name, at /<name>, each with its own args over the
    shipped ones (`engine` merged setting by setting). Written to `path`, which is returned."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    base = config["applications"][0]
    config["applications"] = [
        {
            **base,
            "name": name,
            "route_prefix": f"/{name}",
            "args": {
                **base["args"],
                **args,
                "engine": {**base["args"]["engine"], **args.get("engine", {})},
            },
        }
        for name, args in app_args.items()
    ]
    path.write_text(yaml.safe_dump(config))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServeCluster:
    ray_address: str
    metrics_url: str  # Ray's metrics export endpoint on this node
    base_url: str  # http://127.0.0.1:<port>
    app_name: str
    serve_run: subprocess.Popen

    def wait_ready(self, route_prefix: str = "") -> None:
        """Until the app at `route_prefix` answers /health."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.serve_run.poll() is not None:
                raise RuntimeError(f"`serve run` exited with {self.serve_run.returncode}")
            try:
                if httpx.get(f"{self.base_url}{route_prefix}/health", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"the app did not become healthy in {START_TIMEOUT_S} s")


def start(config_path: Path, log_dir: Path) -> ServeCluster:
    gcs_port, http_port, metrics_port = free_port(), free_port(), free_port()
    # A throwaway cluster on loopback: no token auth (ray start and its clients would otherwise
    # disagree on where the token lives), no usage stats.
    os.environ["RAY_AUTH_MODE"] = "disabled"  # for this process's own driver, too
    # Workers report metrics every second (default 10 s), so tests see them sooner.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_metrics_report_interval_ms": "1000"}
    subprocess.run(
        [
            BIN / "ray",
            "start",
            "--head",
            f"--port={gcs_port}",
            f"--metrics-export-port={metrics_port}",
            "--disable-usage-stats",
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    config = yaml.safe_load(config_path.read_text())
    config["http_options"]["port"] = http_port
    config["http_options"]["host"] = "127.0.0.1"
    test_config = log_dir / config_path.name
    test_config.write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{gcs_port}"
    serve_run = subprocess.Popen(
        [BIN / "serve", "run", str(test_config)],
        cwd=REPO,
        env={**env, "RAY_ADDRESS": address},
        stdout=(log_dir / "serve_run.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    return ServeCluster(
        address,
        f"http://127.0.0.1:{metrics_port}/metrics",
        f"http://127.0.0.1:{http_port}",
        config["applications"][0]["name"],
        serve_run,
    )


def post_concurrently(url: str, body: dict, count: int) -> list[httpx.Response]:
    async def post_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(http.post(url, json=body) for _ in range(count)))

    return asyncio.run(post_all())


def scrape(cluster: ServeCluster, name: str, labels: dict[str, str]) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
    return sum(scrape_by_replica(cluster, name, labels).values())


def scrape_by_replica(cluster: ServeCluster, name: str, labels: dict[str, str]) -> dict[str, float]:
    """The samples called `name` whose labels include `labels`, summed per `replica` label."""
    text = httpx.get(cluster.metrics_url, timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                replica = sample.labels.get("replica", "")
                values[replica] = values.get(replica, 0.0) + sample.value
    return values


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + REPORT_WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {REPORT_WAIT_S} s: {what}"
        time.sleep(0.5)


def stop(cluster: ServeCluster) -> None:
    cluster.serve_run.send_signal(signal.SIGINT)  # serve run tears its applications down
    try:
        cluster.serve_run.wait(timeout=60)
    except subprocess.TimeoutExpired:
        cluster.serve_run.kill()
    subprocess.run([BIN / "ray", "stop", "--force"], capture_output=True)
