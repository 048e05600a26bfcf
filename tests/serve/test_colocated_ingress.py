"""`ingress: colocated` on the real cluster: the shipped app (one replica, so `ingress: auto` makes
it colocated: the API and its engine in one replica, no Ray hop per request or token) answers as
the same args with `ingress: separate` (an Ingress in front of an EngineReplica) do, streams through
the official `openai` client, and frees a request's KV blocks when its client hangs up."""

from __future__ import annotations

import asyncio
import pickle

import openai
import pytest
import yaml
from ray import serve

from deployments.app import AppArgs, build_app
from harness.replicas import engine_stats
from harness.serve_cluster import REPO, ServeCluster, delete_app, wait_for
from harness.sse_client import client_session, stream_completion

APP = "separate"
CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0}
HTTP_TIMEOUT_S = 300  # hang detectors only


@pytest.fixture(scope="module")
def separate(serve_cluster: ServeCluster) -> str:
    """The shipped app's args with `ingress: separate`, beside it on the session's cluster
    (num_cpus 0: the 2-core cluster has no CPU left to reserve)."""
    shipped = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"][0]["args"]
    serve.run(
        build_app(AppArgs(**{**shipped, "ingress": "separate", "num_cpus": 0})),
        name=APP,
        route_prefix=f"/{APP}",
    )
    yield f"{serve_cluster.base_url}/{APP}"
    delete_app(APP)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def test_the_shipped_app_answers_as_its_separate_shape_does(serve_cluster: ServeCluster, separate: str):
    assert set(serve.status().applications[serve_cluster.app_name].deployments) == {"Ingress"}
    assert set(serve.status().applications[APP].deployments) == {"Ingress", "EngineReplica"}
    ours = client(serve_cluster.base_url)
    model = ours.models.list().data[0].id
    whole = ours.chat.completions.create(model=model, **CHAT)
    apart = client(separate).chat.completions.create(model=model, **CHAT)
    assert whole.choices[0].message.content == apart.choices[0].message.content
    assert whole.usage.completion_tokens == apart.usage.completion_tokens > 0
    chunks = ours.chat.completions.create(model=model, stream=True, **CHAT)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].message.content


def test_an_answer_over_grpcs_default_message_limit_crosses_the_hop(separate: str):
    """The Ingress calls its EngineReplica over Serve's gRPC, whose default limit is 4 MiB a
    message: 1,200 inputs' embeddings (576 floats each, pickled at 9 bytes a float: ~6 MiB) come
    back from the replica as one message, under the limit the app sets."""
    inputs = [f"input {i}" for i in range(1200)]
    apart = client(separate)
    model = apart.models.list().data[0].id
    answer = apart.embeddings.create(model=model, input=inputs, encoding_format="float")
    assert [data.index for data in answer.data] == list(range(len(inputs)))
    assert all(len(data.embedding) == 576 for data in answer.data)
    assert len(pickle.dumps([data.embedding for data in answer.data])) > 4 << 20


def test_a_client_that_hangs_up_frees_its_kv_blocks(serve_cluster: ServeCluster):
    long = {"prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True}

    async def hang_up() -> bool:
        async with client_session(HTTP_TIMEOUT_S) as http:
            result = await stream_completion(
                http, f"{serve_cluster.base_url}/v1/completions", long, disconnect_after_chunks=3
            )
            return result.disconnected and result.finish_reason is None

    assert asyncio.run(hang_up())
    wait_for(lambda: engine_stats(serve_cluster.app_name).num_running == 0, "the request is aborted")
    wait_for(lambda: engine_stats(serve_cluster.app_name).kv_cache_usage == 0, "every KV block is free")


def test_router_settings_are_refused_with_their_name():
    with pytest.raises(ValueError, match="request_router: not with ingress: colocated"):
        AppArgs(ingress="colocated", request_router="round_robin")


def test_auto_is_colocated_for_one_fixed_replica_only():
    assert AppArgs().colocated()
    assert not AppArgs(num_replicas=2).colocated()
    assert not AppArgs(num_replicas="auto").colocated()
    assert not AppArgs(request_router="round_robin").colocated()
    assert not AppArgs(ingress="separate").colocated()
    assert AppArgs(ingress="colocated", num_replicas=2).colocated()
