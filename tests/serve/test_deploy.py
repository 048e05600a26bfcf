"""The README's way to run the app on a Ray cluster, step by step and exactly as written, from a
clean state: `ray start --head`, `serve deploy serve_config.yaml`, `serve status`, a chat
completion through the official client, `serve shutdown -y`, `ray stop`. A change in Ray's
defaults (2.60 turned on token authentication for clusters with a token) fails here, not for
our users.

HOME is a new, empty directory, as on a new machine: no Ray token exists until the documented
step makes one. The test runs before every other (conftest.py orders it): its `ray stop` stops
every Ray process on this machine, and the session's shared test cluster starts after it."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import openai
import pytest
import yaml

from common.model_source import cache_root
from harness.serve_cluster import BIN, REPO, START_TIMEOUT_S

pytestmark = pytest.mark.own_ray_cluster
# Deadlines on state (hang detectors), sized for a 2-core machine under full load, where starting
# the app took minutes (harness.serve_cluster.START_TIMEOUT_S says more).
DEPLOY_TIMEOUT_S = START_TIMEOUT_S
COMMAND_TIMEOUT_S = 600


def _run(command: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    program, *args = command.split()
    result = subprocess.run(
        [str(BIN / program), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    if check:
        assert result.returncode == 0, (
            f"`{command}` failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def _app_status(env: dict[str, str]) -> str | None:
    status = yaml.safe_load(_run("serve status", env).stdout) or {}
    return (status.get("applications") or {}).get("stallfree", {}).get("status")


def test_the_documented_serve_deploy_steps_work_from_a_clean_state(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))  # built kernels
    env.update(
        HOME=str(tmp_path),  # a new machine: no ~/.ray/auth_token yet
        STALLFREE_CACHE_DIR=str(cache_root()),  # the converted model, not a second conversion
        RAY_USAGE_STATS_ENABLED="0",
    )
    assert _run("ray status", env, check=False).returncode != 0, "a Ray cluster is already running here"
    env["RAY_AUTH_MODE"] = "token"  # the docs: `export RAY_AUTH_MODE=token`
    env["RAY_worker_niceness"] = "0"  # the docs: `export RAY_worker_niceness=0`
    try:
        _run("ray get-auth-token --generate", env)
        assert (tmp_path / ".ray" / "auth_token").is_file()
        _run("ray start --head", env)
        _run("serve deploy serve_config.yaml", env)
        deadline = time.monotonic() + DEPLOY_TIMEOUT_S
        while (status := _app_status(env)) != "RUNNING":
            assert status in (None, "NOT_STARTED", "DEPLOYING"), f"the app is {status}"
            assert time.monotonic() < deadline, f"not RUNNING after {DEPLOY_TIMEOUT_S} s"
            time.sleep(2)
        client = openai.OpenAI(base_url="http://localhost:8000/v1", api_key="unused")
        chat = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
        )
        assert "Paris" in chat.choices[0].message.content
        _run("serve shutdown -y", env)
        assert _app_status(env) is None
        _run("ray stop", env)
        assert _run("ray status", env, check=False).returncode != 0
    finally:
        _run("ray stop --force", env, check=False)
