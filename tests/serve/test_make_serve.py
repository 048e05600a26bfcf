"""`make serve` as a user runs it right after `make test`: /tmp/ray/ray_current_cluster names a
cluster that has ended (a test cluster's, or the user's own that crashed), and `make serve` still
starts a cluster of its own and answers, instead of attaching to the dead one and waiting for
ever. The pointer is put back afterwards: the test leaves the user's Ray state as it found it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import openai
import pytest
from ray._common.utils import get_ray_address_file

from common.ports import free_port
from harness.serve_cluster import REPO, START_TIMEOUT_S, end_session, ray_address_file_kept, wait_for_http

pytestmark = pytest.mark.own_ray_cluster
# Ctrl-C waits out the Ingress's draining period (3 s under `make serve`: docs/deployment.md) and
# the replicas' graceful shutdown; on loaded cores, with Serve's 30 s period, it took over 120 s
STOP_TIMEOUT_S = 300


def test_make_serve_starts_its_own_cluster_whatever_a_dead_pointer_says(tmp_path: Path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    log = tmp_path / "make_serve.log"
    with ray_address_file_kept():
        pointer = Path(get_ray_address_file(None))
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.write_text(f"127.0.0.1:{free_port()}")  # no GCS listens there
        make = subprocess.Popen(
            ["make", "serve"], cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            wait_for_http(
                "http://127.0.0.1:8000/health", make, "`make serve`", START_TIMEOUT_S,
                log_tail=lambda: "\n" + log.read_text()[-3000:],
            )  # fmt: skip
            client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", max_retries=0)
            answer = client.completions.create(model="smollm2-135m-instruct", prompt="Hello", max_tokens=4)
            assert answer.usage.completion_tokens == 4
        finally:
            os.killpg(make.pid, signal.SIGINT)  # Ctrl-C
            try:
                make.wait(timeout=STOP_TIMEOUT_S)
            finally:
                end_session(make.pid)  # whatever of its cluster is left
