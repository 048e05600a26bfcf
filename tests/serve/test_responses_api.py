"""OpenAI's Responses API (/v1/responses): the body as the chat request it is answered as, and the
chat answer rewritten as a Response and its events, checked against the `openai` client's own
types (no Ray); then through the shared app with the official client, where each answer must be
the chat endpoint's answer to the same conversation, and an agent's tool loop runs."""

from __future__ import annotations

import asyncio
import json
import typing
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from common.errors import InvalidRequestError
from deployments.protocol import ApiError, parse_body
from deployments.responses_api import ResponsesRequest, renamed_params
from deployments.responses_output import ResponseShape, ResponseStream
from harness.serve_cluster import ServeCluster
from harness.tool_schemas import PROMPTS, call_problem, tools

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "name": "GetWeather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city", "unit"],
    },
}
# each event type's class in the client (its union's members, by their `type` literal)
EVENTS = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"model": MODEL, **fields}), strict=True)


def test_input_items_become_the_chat_conversation():
    body = request(
        instructions="Answer briefly.",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},  # an earlier turn's: dropped
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "GetWeather",
                "arguments": '{"city": "Paris"}',
            },
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "GetWeather",
                "arguments": '{"city": "Nice"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "20 C"}],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "GetWeather"},
        max_output_tokens=40,
        top_logprobs=2,
    )
    chat = body.chat_request()
    assert chat.conversation() == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "GetWeather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "GetWeather", "arguments": {"city": "Nice"}},
                },
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "20 C", "tool_call_id": "call_2"},
    ]
    assert chat.max_completion_tokens == 40 and chat.output_logprobs == 2 and chat.tool_mode == "named"
    assert chat.tools[0].function.parameters == WEATHER["parameters"]
    plain = request(
        input="Hi", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
    )
    assert plain.chat_request().conversation() == [{"role": "user", "content": "Hi"}]
    assert plain.chat_request().response_format.json_schema.schema_ == {"type": "object"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"role": "critic", "content": "x"}]}, "input"),
        ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "Hi", "top_logprobs": 21}, "top_logprobs"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),  # no tools to call
        ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]}, "input"),
    ],
)
def test_bad_bodies_get_400_naming_the_responses_field(fields: dict[str, Any], param: str):
    with pytest.raises((ApiError, InvalidRequestError)) as error, renamed_params():
        chat = parse_body(ResponsesRequest, json.dumps({"model": MODEL, **fields}).encode()).chat_request()
        chat.conversation()
        chat.sampling({}, call_format="hermes")
    problem = error.value
    assert (problem.body["error"]["param"] if isinstance(problem, ApiError) else problem.param) == param


async def _chunks(chunks: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for chunk in chunks:
        yield chunk


def _chunk(delta: dict[str, Any], finish: str | None = None, logprobs: list | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice], "usage": None}


USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 5,
    "total_tokens": 12,
    "prompt_tokens_details": {"cached_tokens": 3},
}


def _logprob(token: str) -> dict[str, Any]:
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}


def test_a_streamed_answer_is_the_clients_events_and_joins_up_to_the_whole():
    """Reasoning, then text, then two calls: every event parses as the openai client's types,
    numbered in order, each item opened before its deltas and closed before the next, and the
    final response is the whole answer's."""
    call = {
        "index": 0,
        "id": "call_a",
        "type": "function",
        "function": {"name": "GetWeather", "arguments": ""},
    }
    chunks = [
        _chunk({"role": "assistant", "reasoning_content": "The user "}),
        _chunk({"reasoning_content": "wants weather."}),
        _chunk({"content": "Let me"}, logprobs=[_logprob("Let"), _logprob(" me")]),
        _chunk({"content": " check."}, logprobs=[_logprob(" check"), _logprob(".")]),
        _chunk({"tool_calls": [call]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris",'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "unit": "C"}'}}]}),
        _chunk(
            {
                "tool_calls": [
                    {
                        **call,
                        "index": 1,
                        "id": "call_b",
                        "function": {"name": "GetWeather", "arguments": "{}"},
                    }
                ]
            }
        ),
        _chunk({}, finish="tool_calls"),
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": USAGE},
    ]
    shape = ResponseShape(request(input="Weather?", tools=[WEATHER]), "1", MODEL)

    async def collect() -> list[str]:
        return [event async for event in ResponseStream(shape).events(_chunks(chunks))]

    raw = asyncio.run(collect())
    events = []
    for text in raw:
        head, data = text.split("\n", 1)
        body = json.loads(data.removeprefix("data: "))
        event = EVENTS[body["type"]].model_validate(body)
        assert head == f"event: {event.type}" and text.endswith("\n\n")
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "The user wants weather."
    assert final.output_text == "Let me check." and len(final.output[1].content[0].logprobs) == 4
    assert [(c.call_id, c.arguments) for c in final.output[2:]] == [
        ("call_a", '{"city": "Paris", "unit": "C"}'),
        ("call_b", "{}"),
    ]
    assert (
        final.usage.input_tokens,
        final.usage.output_tokens,
        final.usage.input_tokens_details.cached_tokens,
    ) == (7, 5, 3)
    # each item: added, its deltas, done; the deltas join up to what its done event says
    opened, text = {}, {}
    for event in events[1:-1]:
        if event.type == "response.output_item.added":
            assert not [i for i in opened.values() if i == "open"], "an item opened before the last closed"
            opened[event.item.id] = "open"
        elif event.type.endswith(".delta"):
            assert opened[event.item_id] == "open"
            text[event.item_id] = text.get(event.item_id, "") + event.delta
        elif event.type in ("response.output_text.done", "response.reasoning_text.done"):
            assert event.text == text[event.item_id]
        elif event.type == "response.function_call_arguments.done":
            assert event.arguments == text[event.item_id]
        elif event.type == "response.output_item.done":
            opened[event.item.id] = "done"
    assert list(opened.values()) == ["done"] * 4
    # the same answer whole
    whole_chat = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "logprobs": {"content": [_logprob(t) for t in ("Let", " me", " check", ".")]},
                "message": {
                    "role": "assistant",
                    "reasoning_content": "The user wants weather.",
                    "content": "Let me check.",
                    "tool_calls": [
                        {
                            "id": "call_a",
                            "type": "function",
                            "function": {"name": "GetWeather", "arguments": '{"city": "Paris", "unit": "C"}'},
                        },
                        {
                            "id": "call_b",
                            "type": "function",
                            "function": {"name": "GetWeather", "arguments": "{}"},
                        },
                    ],
                },
            }
        ],
        "usage": USAGE,
    }
    whole = Response.model_validate(shape.whole(whole_chat))
    assert whole.model_dump(exclude={"created_at"}) == final.model_dump(exclude={"created_at"})


def test_a_cut_short_answer_is_incomplete():
    shape = ResponseShape(request(input="Hi", max_output_tokens=2), "2", MODEL)
    chat = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "logprobs": None,
                "message": {"role": "assistant", "content": "Hello there"},
            }
        ],
        "usage": USAGE,
    }
    whole = Response.model_validate(shape.whole(chat))
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete" and whole.output_text == "Hello there"


def test_the_end_of_text_tokens_logprob_is_left_out_streamed_or_whole():
    """An answer that ends on the end-of-text token: its logprob comes with no text, so the
    output text's logprobs are its other tokens', whole as streamed (the token alone in the
    last chunk, or in one chunk with the last text: a busy server sends several tokens a chunk)."""
    shape = ResponseShape(request(input="Name a color.", top_logprobs=1), "3", MODEL)
    tokens = ["Blue", "."]
    end = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": USAGE}
    alone = [
        _chunk({"role": "assistant", "content": "Blue."}, logprobs=[_logprob(t) for t in tokens]),
        _chunk({}, finish="stop", logprobs=[_logprob("<|im_end|>")]),
        end,
    ]
    together = [
        _chunk({"role": "assistant", "content": "Blue"}, logprobs=[_logprob("Blue")]),
        _chunk({"content": "."}, finish="stop", logprobs=[_logprob("."), _logprob("<|im_end|>")]),
        end,
    ]

    def streamed(chunks: list[dict[str, Any]]) -> Response:
        async def collect() -> list[str]:
            return [event async for event in ResponseStream(shape).events(_chunks(chunks))]

        return Response.model_validate(
            json.loads(asyncio.run(collect())[-1].split("data: ", 1)[1])["response"]
        )

    message = {"role": "assistant", "content": "Blue."}
    logprobs = {"content": [_logprob(t) for t in [*tokens, "<|im_end|>"]]}
    chat = {
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": logprobs, "message": message}],
        "usage": USAGE,
    }
    whole = Response.model_validate(shape.whole(chat))
    for response in (streamed(alone), streamed(together), whole):
        assert [p.token for p in response.output[0].content[0].logprobs] == tokens


# --- through the shared app, with the official client ---


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{serve_cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=600
    )


def test_a_response_is_the_chat_answer_to_the_same_conversation(client: openai.OpenAI):
    fields = {"temperature": 0, "max_output_tokens": 24}
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="Name a color.", **fields)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
        temperature=0,
        max_tokens=24,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    streamed = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Name a color.", stream=True, **fields
    )
    events = list(streamed)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert deltas == final.response.output_text == response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    scoring = {"top_logprobs": 2, "include": ["message.output_text.logprobs"], **fields}
    scored = client.responses.create(model=MODEL, input="Name a color.", **scoring)
    logprobs = scored.output[0].content[0].logprobs
    # One per token of the text: an answer that ends on the end-of-text token counts it in its
    # usage, and it has no text.
    ended = scored.status == "completed"
    assert len(logprobs) == scored.usage.output_tokens - ended and all(
        len(p.top_logprobs) == 2 for p in logprobs
    )
    assert "".join(p.token for p in logprobs) == scored.output_text
    events = list(client.responses.create(model=MODEL, input="Name a color.", stream=True, **scoring))
    streamed_logprobs = events[-1].response.output[0].content[0].logprobs
    assert [(p.token, p.logprob) for p in streamed_logprobs] == [(p.token, p.logprob) for p in logprobs]


def test_an_agents_tool_loop_runs_on_responses(client: openai.OpenAI):
    """Call a tool (required), send its output back as input items, get the answer: as the
    OpenAI Agents SDK drives the API, with the whole conversation each turn (store: false)."""
    agent_tools = [{"type": "function", **t["function"]} for t in tools()]
    first = client.responses.create(
        model=MODEL, input=PROMPTS[1], tools=agent_tools, tool_choice="required", temperature=0, store=False
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        assert call_problem(call.name, call.arguments) is None, call
    streamed = client.responses.create(
        model=MODEL, input=PROMPTS[1], tools=agent_tools, tool_choice="required", temperature=0, stream=True
    )
    final_event = list(streamed)[-1]
    assert final_event.type == "response.completed"
    assert [(c.name, c.arguments) for c in final_event.response.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    history = [
        {"role": "user", "content": PROMPTS[1]},
        *[item.model_dump(exclude_none=True) for item in first.output],
        *({"type": "function_call_output", "call_id": c.call_id, "output": "18 C and sunny"} for c in calls),
    ]
    final = client.responses.create(
        model=MODEL, input=history, tools=agent_tools, temperature=0, max_output_tokens=60, store=False
    )
    assert final.output and final.status in ("completed", "incomplete")
    if not [item for item in final.output if item.type == "function_call"]:
        assert final.output_text


def test_bad_responses_requests_get_openai_errors(serve_cluster: ServeCluster):
    url = f"{serve_cluster.base_url}/v1/responses"
    for body, param in (
        ({"model": MODEL, "input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"model": MODEL, "input": "Hi", "tools": [{"type": "file_search"}]}, "tools"),
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL}, "input"),
        ({"model": "gpt-4", "input": "Hi"}, "model"),
    ):
        answer = httpx.post(url, json=body, timeout=60)
        assert 400 <= answer.status_code < 500 and answer.json()["error"]["param"] == param, answer.text
