"""A real local Ray cluster running `serve run <config>`, for the end-to-end tests and benchmarks.

The cluster is started with `ray start --head` (so the tests' own driver can attach to it for
replica stats), then the documented `serve run` deploys the repository's serve_config.yaml onto
it, with only the HTTP port moved to a free one.

`ray start` runs in a session of its own, which its daemons and workers inherit: stopping the
cluster ends that session's processes, never `ray stop --force`, which kills every Ray on the
host (a user's own cluster, a second test run)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml
from ray._common.utils import get_ray_address_file

from common.ports import free_ports

REPO = Path(__file__).resolve().parents[1]


def _console_scripts() -> Path:
    """Where `ray` and `serve` are: beside this interpreter (a venv), else on PATH (a machine
    where Ray was installed with --target, as bench/gpu/gpu_machine.sh does)."""
    beside = Path(sys.executable).parent
    found = shutil.which("ray")
    return beside if (beside / "ray").exists() or found is None else Path(found).parent


BIN = _console_scripts()
# A deadline on state: `serve run` answers /health in ~30 s on an idle 2-core machine; beside two
# busy processes, importing and building the app alone took 2 minutes, and starting it 5.
START_TIMEOUT_S = 900
# A deadline on state: Ray's workers report metrics every second in the test cluster (a figure
# lands within ~2 s on an idle machine); this is for a 2-core machine under full load.
REPORT_WAIT_S = 60
# A throwaway cluster on loopback: no token auth (ray start and its clients would otherwise disagree
# on where the token lives), no usage stats, and Serve's proxy checks given a loaded 2-core
# machine's time: within the default 5 s, a proxy still starting beside two busy processes was
# killed and `serve run` failed. Ray starts its workers (Serve's replicas, proxy and controller
# among them) at nice 15: beside any busy process at nice 0 they got a few percent of a core and
# every wait ran out, so the cluster's workers run at the same priority as everything else (as
# `make serve` runs them). Serve's HAProxy ingress and user code on each replica's own event loop,
# as `make serve` runs them (docs/deployment.md), and Serve's controller looping twice a second
# rather than ten times (at rest it was a quarter of the idle cluster's CPU). Benchmarks run this:
# Ray's own report intervals, what a user's cluster has.
BENCH_CLUSTER_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}
# Tests, on top: workers report metrics every second (default 10 s) so tests see them sooner. A
# node's metrics agent drops a gauge series not re-sent within two report intervals (2 s here),
# and Serve's controller re-sends an unchanged status gauge (replicas healthy, app status) only
# every 10 s: its series showed ~2 s in 10 and Prometheus's 5 s scrapes could miss it for minutes.
# The controller re-sends them twice per report interval instead (at Ray's default 10 s interval
# the agent keeps a series 20 s, so a default cluster has no gap). Both cost the cores a little
# every second, which is why benchmarks leave them out.
# And an Ingress replica that stops (an app deleted, a downscale) stays reachable 3 s, not 30, for
# HAProxy to drop it: this machine's HAProxy reloads within that, and it retries a refused
# connection on another replica anyway. At 30 s, the tests' app deletions alone took ~10 minutes.
TEST_CLUSTER_ENV = {
    **BENCH_CLUSTER_ENV,
    "RAY_metrics_report_interval_ms": "1000",
    "RAY_SERVE_STATUS_GAUGE_REPORT_INTERVAL_S": "0.5",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "3",
}


SHIPPED_CONFIG = REPO / "serve_config.yaml"


def shipped_app_config(path: Path = SHIPPED_CONFIG) -> dict:
    """serve_config.yaml (or another shipped config), parsed: its one application is the app."""
    return yaml.safe_load(path.read_text())


def with_app_args(shipped: dict, app_args: dict) -> dict:
    """`app_args` over the shipped app's args, `engine` merged setting by setting."""
    return {**shipped, **app_args, "engine": {**shipped["engine"], **app_args.get("engine", {})}}


def config_with_apps(path: Path, app_args: dict[str, dict], base: Path = SHIPPED_CONFIG) -> Path:
    """`base` (serve_config.yaml) with its app once per name, at /<name>, each with its own args
    over the shipped ones (`engine` merged setting by setting). Written to `path`, returned."""
    config = shipped_app_config(base)
    base = config["applications"][0]
    config["applications"] = [
        {**base, "name": name, "route_prefix": f"/{name}", "args": with_app_args(base["args"], args)}
        for name, args in app_args.items()
    ]
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class ServeCluster:
    ray_address: str
    metrics_url: str  # Ray's metrics export endpoint on this node
    base_url: str  # http://127.0.0.1:<port>
    app_name: str
    serve_run: subprocess.Popen
    session_id: int  # of `ray start` and every process of the cluster

    def wait_ready(self, route_prefix: str = "") -> None:
        """Until the app at `route_prefix` answers /health."""
        wait_for_http(f"{self.base_url}{route_prefix}/health", self.serve_run, "`serve run`", START_TIMEOUT_S)


def wait_for_http(
    url: str,
    process: subprocess.Popen,
    what: str,
    timeout_s: float,
    interval_s: float = 1.0,
    log_tail: Callable[[], str] = str,
) -> None:
    """Until `url` answers 200: RuntimeError if the server's `process` exits first, TimeoutError
    after `timeout_s`; either says `log_tail()` (the end of the server's log, where it has one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}{log_tail()}")
        try:
            if httpx.get(url, timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{what} did not answer {url} in {timeout_s} s{log_tail()}")


@contextlib.contextmanager
def ray_address_file_kept() -> Iterator[None]:
    """`ray start` records its cluster in /tmp/ray/ray_current_cluster, which `ray.init()` and
    `serve run` attach to; a test cluster ends without `ray stop` (which would clear it), so a
    user's `make serve` after `make test` waited for ever on a dead cluster. Put back what was
    there (a user's own cluster), or nothing. (Not a temp dir of our own: Prometheus finds the
    nodes through the service discovery file Ray writes there, as dashboards/prometheus.yml says.)"""
    path = Path(get_ray_address_file(None))
    before = path.read_text() if path.exists() else None
    try:
        yield
    finally:
        if before is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(before)


def start(
    config_path: Path,
    log_dir: Path,
    env: dict[str, str] | None = None,
    cluster_env: dict[str, str] = TEST_CLUSTER_ENV,
) -> ServeCluster:
    """A one-node cluster serving `config_path`; `cluster_env` (the tests', or BENCH_CLUSTER_ENV)
    and `env` on top of this process's for every process of the cluster (Serve's and Ray's
    settings read from the environment)."""
    # free on every address, and distinct: HAProxy binds its stats port on 0.0.0.0, which a port
    # held on any address fails (a run of make test saw "Address already in use" there)
    gcs_port, http_port, metrics_port, *haproxy_ports = free_ports(5, host="")
    os.environ["RAY_AUTH_MODE"] = cluster_env["RAY_AUTH_MODE"]  # for this process's own driver, too
    env = {**os.environ, **cluster_env, **(env or {})}
    if env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":  # its stats and metrics ports are fixed ones
        names = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
        env |= {name: str(port) for name, port in zip(names, haproxy_ports, strict=True)}
    with ray_address_file_kept():
        ray_start = subprocess.Popen(
            [
                BIN / "ray",
                "start",
                "--head",
                f"--port={gcs_port}",
                f"--metrics-export-port={metrics_port}",
                "--disable-usage-stats",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        output, _ = ray_start.communicate()
    if ray_start.returncode != 0:
        raise RuntimeError(f"ray start failed ({ray_start.returncode}): {output.decode()[-2000:]}")
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
        ray_start.pid,
    )


def post_concurrently(url: str, body: dict, count: int) -> list[httpx.Response]:
    async def post_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(http.post(url, json=body) for _ in range(count)))

    return asyncio.run(post_all())


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + REPORT_WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {REPORT_WAIT_S} s: {what}"
        time.sleep(0.5)


def stop(cluster: ServeCluster) -> None:
    """End every process of the cluster's session. No graceful teardown first: `serve run`'s own
    (on SIGINT) waits out each Ingress's draining period and took 15-20 s, and proves nothing."""
    cluster.serve_run.kill()  # not in the session: started by this process, in its session
    cluster.serve_run.wait()
    end_session(cluster.session_id)


def end_session(session_id: int, grace_s: float = 2) -> None:
    """SIGTERM every process of the session, then SIGKILL what is left after `grace_s` (Ray's GCS
    and runtime-env agent ignore SIGTERM for 10 s and more)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = session_pids(session_id)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while session_pids(session_id) and time.monotonic() < deadline:
            time.sleep(0.2)


def delete_app(name: str) -> None:
    """Delete an app without waiting for it to go (a test's teardown): its Ingress stays reachable
    for the draining period and Serve's client polls once a second, 5 s a deletion in the tests.
    App names are never reused; a later deploy that needs the CPUs it held waits for them."""
    from ray import serve

    serve.delete(name, _blocking=False)


def session_pids(session_id: int) -> list[int]:
    """The live processes of a session (a cluster's: `ray start` and everything it starts)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # it ended while we looked
            continue
        if int(fields[3]) == session_id and fields[0] != "Z":  # field 6 of stat: the session
            pids.append(int(stat.parent.name))
    return pids
