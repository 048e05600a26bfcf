"""Routing by LoRA adapter on the real Ray cluster: two CPU replicas of the real SmolLM2, a real
PEFT adapter (random weights, written by `peft`). Once one replica has loaded the adapter, the
adapter's requests go there; base-model requests still spread. The pure parts are tested without
Ray in tests/fleet/test_adapter_routing.py, the fleet-level effect in tests/sim/test_lora_routing.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from ray import serve

from common.lora import LoRARequest
from common.messages import GenerateRequest
from common.sampling_params import SamplingParams
from deployments.app import AppArgs, build_app
from harness.lora_adapters import save_random_adapter
from harness.metrics_scrape import EngineCounters
from harness.serve_cluster import ServeCluster, delete_app, wait_for

APP = "lora-routing"
BASE = "smollm2-135m-instruct"
DEADLINE_S = 600  # a hang detector on a busy 2-core machine
REPORTS_S = 2.0  # four report periods: every router has seen the adapter in the holder's report


@pytest.fixture(scope="module")
def adapter(hf_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_adapter(hf_model, tmp_path_factory.mktemp("lora-routing") / "sql", seed=7)


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster, adapter: Path):
    args = AppArgs(
        num_replicas=2,
        num_cpus=0,
        cpu_threads=1,
        engine={"num_kv_blocks": 64, "max_model_len": 512},
        lora_modules=[f"sql={adapter}"],
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield openai.OpenAI(
        base_url=f"{serve_cluster.base_url}/{APP}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S
    )
    delete_app(APP)


def finished_by_replica(cluster: ServeCluster) -> dict[str, float]:
    return EngineCounters.scrape(cluster, APP).finished_by_replica


def new_finishes(cluster: ServeCluster, before: dict[str, float], expected: int) -> dict[str, float]:
    """Requests finished per replica since `before`, once `expected` of them are exported."""

    def delta() -> dict[str, float]:
        after = finished_by_replica(cluster)
        return {r: after[r] - before.get(r, 0.0) for r in after if after[r] > before.get(r, 0.0)}

    wait_for(lambda: sum(delta().values()) >= expected, f"{expected} finished requests exported")
    return delta()


def complete(client: openai.OpenAI, model: str, prompt: str) -> None:
    client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)


def test_an_adapters_requests_go_to_the_replica_that_loaded_it(
    serve_cluster: ServeCluster, client: openai.OpenAI, adapter: Path
):
    before = finished_by_replica(serve_cluster)
    complete(client, "sql", "SELECT the first")  # both idle: it loads on either
    (holder,) = new_finishes(serve_cluster, before, 1)
    time.sleep(REPORTS_S)

    # Through the Ingress's router, a burst with prompts sharing nothing: the adapter alone draws them.
    before = finished_by_replica(serve_cluster)
    prompts = [f"Question {i}: how many rows has table t{i}?" for i in range(4)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda prompt: complete(client, "sql", prompt), prompts))
    assert new_finishes(serve_cluster, before, len(prompts)) == {holder: len(prompts)}

    # From this process, whose router knows the replicas by their reports alone (it sent nothing).
    before = finished_by_replica(serve_cluster)
    handle = serve.get_deployment_handle("EngineReplica", app_name=APP).options(stream=True)
    lora = LoRARequest("sql", str(adapter))
    for i in range(3):
        params = SamplingParams(max_tokens=2, temperature=0, lora=lora)
        request = GenerateRequest(f"handle-{i}", [[1000 + 37 * i + j for j in range(12)]], [params])
        list(handle.generate.remote(request))
    assert new_finishes(serve_cluster, before, 3) == {holder: 3}

    # Base-model requests are not drawn there (the other replica, with less idle cached content,
    # is the cheaper one for a prompt nobody holds): both replicas serve.
    before = finished_by_replica(serve_cluster)
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda prompt: complete(client, BASE, prompt), prompts))
    assert set(new_finishes(serve_cluster, before, len(prompts))) - {holder}
