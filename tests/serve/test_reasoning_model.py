"""A Qwen3-shaped model that thinks (tests/serve/thinking_model.py: a one-layer `qwen3` whose
weights answer `<think>Hmm</think>Hi`), served by Ray Serve with `reasoning_parser: qwen3` and
asked through the official `openai` client: its thinking streams as `reasoning_content`, then
its answer as content; `enable_thinking: false` reaches the template; and a required tool call
or a JSON schema holds after the thinking, not over it (as vLLM's structured outputs do)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from ray import serve

from deployments.app import AppArgs, build_app
from harness.serve_cluster import ServeCluster, delete_app
from tests.serve.thinking_model import ANSWER, THOUGHT, build

APP = "thinking"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model = build(tmp_path_factory.mktemp("qwen3"))
    args = AppArgs(
        model=str(model),
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        num_cpus=0,  # the 2-core test cluster has no CPU left to reserve
        engine={"dtype": "float32", "max_model_len": 512, "kv_cache_bytes": 16 << 20},
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    try:
        yield openai.OpenAI(base_url=f"{serve_cluster.base_url}/{APP}/v1", api_key="unused", max_retries=0)
    finally:
        delete_app(APP)


def streamed(client: openai.OpenAI, **request: object) -> tuple[str, str, list[tuple[str, str]], str]:
    """(reasoning, content, [(tool name, arguments)], finish reason), joined as a client joins a
    stream's deltas."""
    reasoning, content, calls, finish = "", "", {}, ""
    stream = client.chat.completions.create(model=model_name(client), messages=ASK, stream=True, **request)
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or ():
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (
                    name + (call.function.name or ""),
                    arguments + (call.function.arguments or ""),
                )
            finish = choice.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_thinking_streams_as_reasoning_then_the_answer(client: openai.OpenAI):
    assert streamed(client, temperature=0, max_tokens=32) == (THOUGHT, ANSWER, [], "stop")
    whole = client.chat.completions.create(
        model=model_name(client), messages=ASK, temperature=0, max_tokens=32
    )
    message = whole.choices[0].message
    assert (getattr(message, "reasoning_content", None), message.content) == (THOUGHT, ANSWER)
    # the template closes an empty thinking block: the model answers at once
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert streamed(client, temperature=0, max_tokens=32, extra_body=off) == ("", ANSWER, [], "stop")


def test_a_required_tool_call_and_a_schema_hold_after_the_thinking(client: openai.OpenAI):
    called = streamed(
        client,
        temperature=0,
        max_tokens=200,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    reasoning, content, calls, finish = called
    assert (reasoning, content, finish) == (THOUGHT, "", "tool_calls")
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": WEATHER["function"]["parameters"]},
    }
    reasoning, content, _, finish = streamed(client, temperature=0, max_tokens=200, response_format=schema)
    assert (reasoning, json.loads(content), finish) == (THOUGHT, {"city": "Paris"}, "stop")


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item(client: openai.OpenAI):
    """Whole and streamed: a reasoning item with the thought, then the answer (a message, or the
    required call), each item closed before the next opens."""
    tool = {"type": "function", **WEATHER["function"]}
    for fields, kinds in (
        ({}, ["reasoning", "message"]),
        ({"tools": [tool], "tool_choice": "required"}, ["reasoning", "function_call"]),
    ):
        request = {"model": model_name(client), "input": ASK, "temperature": 0, "max_output_tokens": 200}
        whole = client.responses.create(**request, **fields)
        events = list(client.responses.create(**request, **fields, stream=True))
        final = events[-1].response
        for response in (whole, final):
            assert [item.type for item in response.output] == kinds
            assert response.output[0].content[0].text == THOUGHT and response.status == "completed"
        if kinds[1] == "message":
            assert whole.output_text == final.output_text == ANSWER
        else:
            assert (
                json.loads(whole.output[1].arguments)
                == {"city": "Paris"}
                == json.loads(final.output[1].arguments)
            )
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thought == THOUGHT
