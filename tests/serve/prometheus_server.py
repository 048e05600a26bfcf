"""A real Prometheus (Debian's `prometheus` package) scraping the test cluster through the
repository's dashboards/prometheus.yml, only with a 1 s scrape interval."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import yaml

from harness.serve_cluster import REPO, free_port

READY_TIMEOUT_S = 60


def start(binary: str, work_dir: Path) -> tuple[subprocess.Popen, str]:
    config = yaml.safe_load((REPO / "dashboards" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    config_path = work_dir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={work_dir / 'data'}",
            f"--web.listen-address={url.removeprefix('http://')}",
        ],
        stdout=(work_dir / "prometheus.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/-/ready", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise TimeoutError(
        f"prometheus was not ready in {READY_TIMEOUT_S} s: {(work_dir / 'prometheus.log').read_text()}"
    )


def query(url: str, promql: str) -> list[dict]:
    response = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=30)
    body = response.json()
    assert body["status"] == "success", f"{promql}: {body}"
    return body["data"]["result"]
