"""A Ray Serve LLM user's `LLMConfig`, only its names mapped, deploys on the real cluster and
answers the official `openai` client under its `model_id`."""

from __future__ import annotations

import openai
from ray import serve

from deployments.app import AppArgs, build_app
from harness.serve_cluster import ServeCluster, delete_app

APP = "rayllm"
LLM_CONFIG = {  # as Ray Serve LLM's quickstart writes one, our model in its place, on a CPU
    "model_loading_config": {"model_id": "my-llama", "model_source": "smollm2-135m-instruct"},
    "engine_kwargs": {"max_model_len": 1024, "kv_cache_memory_bytes": 64 << 20},
    "deployment_config": {"max_ongoing_requests": 8},
}


def test_a_ray_serve_llm_config_deploys_and_answers(serve_cluster: ServeCluster):
    # num_cpus 0: the 2-core test cluster has no CPU left to reserve
    serve.run(build_app(AppArgs(llm_config=LLM_CONFIG, num_cpus=0)), name=APP, route_prefix=f"/{APP}")
    try:
        client = openai.OpenAI(base_url=f"{serve_cluster.base_url}/{APP}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["my-llama"]
        chat = client.chat.completions.create(
            model="my-llama",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in chat.choices[0].message.content
    finally:
        delete_app(APP)
