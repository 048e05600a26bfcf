"""A mixture of experts served end to end: a tiny random Qwen3-MoE (harness/tiny_moe.py, with
SmolLM2's tokenizer and ChatML template) deployed by Ray Serve with its experts split over two
workers (`enable_expert_parallel`), asked through the official `openai` client: streamed chat
equals the whole answer and the offline engine's greedy tokens, and a required tool call holds
to the tool's schema (the grammar steers a random model's tokens as any other's)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from ray import serve

from deployments.app import AppArgs, build_app
from harness.serve_cluster import ServeCluster, delete_app
from harness.tiny_moe import save_tiny_moe, tiny_moe
from replica_engine import LLM, SamplingParams
from tests.serve.test_reasoning_model import ASK, WEATHER  # the city an enum: one answer

APP = "moe"
ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_bytes": 16 << 20}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    return save_tiny_moe(tiny_moe("qwen3_moe"), tmp_path_factory.mktemp("qwen3_moe"), model_dir)


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster, checkpoint: Path) -> Iterator[openai.OpenAI]:
    args = AppArgs(
        model=str(checkpoint),
        tool_call_parser="hermes",
        num_cpus=0.1,  # a bundle per worker; the 2-core test cluster has little left to reserve
        cpu_threads=1,
        engine={**ENGINE, "tensor_parallel_size": 2, "enable_expert_parallel": True},
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    try:
        yield openai.OpenAI(base_url=f"{serve_cluster.base_url}/{APP}/v1", api_key="unused", max_retries=0)
    finally:
        delete_app(APP)


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_streamed_chat_equals_the_whole_answer_and_the_offline_engines(
    client: openai.OpenAI, checkpoint: Path
):
    request = dict(model=model_name(client), messages=ASK, temperature=0, max_tokens=16)
    whole = client.chat.completions.create(**request, logprobs=True)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**request, stream=True)
        if chunk.choices
    )
    assert whole.choices[0].message.content == streamed
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    offline = LLM(str(checkpoint), **ENGINE).chat(ASK, SamplingParams(max_tokens=16, temperature=0))
    assert offline[0].outputs[0].text == streamed


def test_a_required_tool_call_holds_to_the_tools_schema(client: openai.OpenAI):
    answer = client.chat.completions.create(
        model=model_name(client),
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=64,
    )
    [call] = answer.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments == {"city": "Paris"}
    assert answer.choices[0].finish_reason == "tool_calls"
