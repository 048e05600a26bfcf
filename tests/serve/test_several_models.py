"""Several models in one app (`models:`), on the real cluster, asked with the official `openai`
client: the embedded SmolLM2 and a Qwen3-shaped model that thinks (thinking_model.py), each with
its own settings and EngineReplica deployment behind one Ingress. A request goes to the model it
names, /v1/models lists both, a name neither serves is a 404, and the HTTP metrics count each
request under its model."""

from __future__ import annotations

import openai
import pytest
from ray import serve

from deployments.app import AppArgs, build_app
from harness.metrics_scrape import scrape
from harness.replicas import engine_deployment
from harness.serve_cluster import ServeCluster, delete_app, wait_for
from tests.serve.thinking_model import ANSWER, THOUGHT, build

APP = "several"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def test_one_app_serves_each_model_by_name(
    serve_cluster: ServeCluster, tmp_path_factory: pytest.TempPathFactory
):
    thinker = build(tmp_path_factory.mktemp("qwen3"))
    args = AppArgs(
        num_cpus=0,  # the 2-core test cluster has no CPU left to reserve
        engine={"dtype": "float32", "max_model_len": 512, "kv_cache_bytes": 32 << 20},
        models=[
            {"served_model_name": "smol"},
            {"model": str(thinker), "served_model_name": "thinker", "reasoning_parser": "qwen3"},
        ],
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    try:
        client = openai.OpenAI(base_url=f"{serve_cluster.base_url}/{APP}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smol", "thinker"]
        assert engine_deployment(APP) == "EngineReplica-1"  # the first model's, for tests and tools
        smol = client.chat.completions.create(model="smol", messages=ASK, max_tokens=16, temperature=0)
        assert "Paris" in smol.choices[0].message.content and smol.model == "smol"
        thought = client.chat.completions.create(model="thinker", messages=ASK, max_tokens=16, temperature=0)
        message = thought.choices[0].message
        assert (getattr(message, "reasoning_content", None), message.content) == (THOUGHT, ANSWER)
        with pytest.raises(openai.NotFoundError) as refused:
            client.chat.completions.create(model="nope", messages=ASK, max_tokens=4)
        assert refused.value.code == "model_not_found"

        def counted(model: str) -> float:
            labels = {
                "application": APP,
                "model_name": model,
                "route": "/v1/chat/completions",
                "status": "200",
            }
            return scrape(serve_cluster, "ray_stallfree_http_requests_total", labels)

        wait_for(
            lambda: counted("smol") == 1 and counted("thinker") == 1, "each request counted under its model"
        )
    finally:
        delete_app(APP)
