"""A tensor-parallel replica through Ray Serve: three worker processes under one EngineReplica,
in a placement group of three bundles, answering the OpenAI API as the whole model does; no KV
block held after."""

from __future__ import annotations

import openai
import pytest
import ray
from ray import serve

from deployments.app import AppArgs, build_app
from harness.replicas import engine_stats
from harness.serve_cluster import ServeCluster, delete_app, wait_for
from replica_engine import SamplingParams

APP = "split"
MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def split_app(serve_cluster: ServeCluster):
    args = AppArgs(num_cpus=0.1, cpu_threads=1, engine={"dtype": "float32", "tensor_parallel_size": 3})
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield openai.OpenAI(base_url=f"{serve_cluster.base_url}/{APP}/v1", api_key="unused", max_retries=0)
    delete_app(APP)


def test_a_three_worker_replica_answers_as_the_whole_model(split_app: openai.OpenAI, exact_llm):
    expected = [
        o.outputs[0].text for o in exact_llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    ]
    answers = [
        split_app.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        for prompt in PROMPTS
    ]
    assert [a.choices[0].text for a in answers] == expected
    groups = ray.util.placement_group_table().values()
    assert any(
        g["state"] == "CREATED" and g["strategy"] == "STRICT_PACK" and len(g["bundles"]) == 3 for g in groups
    )
    wait_for(lambda: engine_stats(APP).kv_cache_usage == 0, "every KV block is free")
    assert engine_stats(APP).num_running == 0


def test_more_workers_than_the_cluster_can_place_fail_the_deploy_naming_the_settings(
    serve_cluster: ServeCluster,
):
    args = AppArgs(num_cpus=64, engine={"dtype": "float32", "tensor_parallel_size": 3})
    with pytest.raises(ValueError, match=r"tensor_parallel_size x pipeline_parallel_size.*STRICT_PACK"):
        build_app(args)
