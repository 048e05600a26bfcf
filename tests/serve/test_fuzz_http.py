"""Property-based fuzzing of the HTTP API: wrong types, huge numbers, unicode, empty and long
strings, nested junk and raw bytes. No response may be a 5xx and none may hang. Runs against an
app with a 32-token context, so even a valid fuzzed request (n up to 128) generates little."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import serve

from deployments.app import AppArgs, build_app
from harness.serve_cluster import ServeCluster, delete_app

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "n", "stream", "stream_options",
    "logprobs", "presence_penalty", "response_format", "echo", "user", "top_logprobs",
    "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "priority",
    "prompt_logprobs", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls",
]  # fmt: skip
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),  # JSON has no NaN
    st.text(max_size=300),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
text_parts = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), max_size=2
)
call = st.fixed_dictionaries(
    {
        "id": st.sampled_from(["call_1", "call_2"]),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {
                "name": st.text(max_size=8),
                "arguments": st.sampled_from(["{}", '{"a": 1}', "{", "3"]) | st.text(),
            }
        ),
    }
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "robot", "tool"]),
            "content": st.none() | st.text(max_size=40) | text_parts | json_values,
        },
        optional={"tool_calls": st.lists(call, max_size=2), "tool_call_id": st.sampled_from(["call_1", "x"])},
    ),
    max_size=3,
)
tool = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "code"]),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g", "bad name", ""])},
            optional={
                "parameters": st.sampled_from(
                    [{"type": "object"}, {"type": "frobnicate"}, {"type": "array", "minItems": 99}, {}]
                )
                | json_values
            },
        ),
    }
)
# Well-typed fields at and past their edges: these get through parsing to the engine.
edgy_fields = {
    "max_tokens": st.integers(-3, 40),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 70000),
    "seed": st.integers(-(2**64), 2**64),
    "n": st.integers(-1, 4),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20),
    "stop_token_ids": st.lists(st.integers(-3, 70000), max_size=4),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.booleans() | st.integers(-2, 25),
    "top_logprobs": st.integers(-2, 25),
    "echo": st.booleans(),
    "prompt_logprobs": st.integers(-2, 25),
    "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "min_p": st.floats(-0.5, 1.5),
    "min_tokens": st.integers(-2, 50),
    "logit_bias": st.dictionaries(
        st.integers(-3, 70000).map(str) | st.text(max_size=3), st.floats(-150, 150)
    ),
    "priority": st.integers(-(2**40), 2**40),
    "tools": st.lists(tool, max_size=3),
    "tool_choice": st.sampled_from(["none", "auto", "required", "always"])
    | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=3)})}
    ),
    "parallel_tool_calls": st.booleans(),
    "response_format": st.sampled_from(
        [
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "minItems": 99}},
            },
            {"type": "json_schema", "json_schema": {"schema": {"enum": []}, "strict": True}},
        ]
    ),
    "structured_outputs": st.fixed_dictionaries(
        {},
        optional={
            "regex": st.text(max_size=8),
            "choice": st.lists(st.text(max_size=5), max_size=3),
            "grammar": st.text(max_size=20),
            "json": json_values,
            "json_object": st.booleans(),
        },
    ),
}
edgy_prompts = (
    st.text(max_size=60)
    | st.lists(st.integers(-3, 70000), max_size=20)
    | st.lists(st.text(max_size=20), max_size=3)
)
bodies = st.one_of(
    st.fixed_dictionaries({"prompt": edgy_prompts}, optional=edgy_fields),
    st.fixed_dictionaries({"messages": messages}, optional=edgy_fields),
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8),
    st.fixed_dictionaries(
        {"prompt": st.text(max_size=200) | st.lists(st.integers(-5, 60000), max_size=40)},
        optional={name: json_values for name in FIELDS if name != "prompt"},
    ),
    st.fixed_dictionaries(
        {"messages": messages}, optional={name: json_values for name in FIELDS if name != "messages"}
    ),
)
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def fuzz_app(serve_cluster: ServeCluster) -> str:
    args = AppArgs(num_cpus=0, engine={"max_model_len": 32, "kv_cache_bytes": 64 << 20, "max_num_seqs": 256})
    serve.run(build_app(args), name="fuzz", route_prefix="/fuzz")
    yield f"{serve_cluster.base_url}/fuzz"
    delete_app("fuzz")


def post(url: str, content: bytes) -> httpx.Response:
    # The timeout is the "never hang" check: a 64-token context finishes well within it.
    return httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=120)


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@FUZZ
@given(body=bodies)
def test_fuzzed_completions_never_get_a_5xx(fuzz_app: str, body: object):
    check(post(f"{fuzz_app}/v1/completions", json.dumps(body).encode()))


@FUZZ
@given(body=bodies)
def test_fuzzed_chat_never_gets_a_5xx(fuzz_app: str, body: object):
    check(post(f"{fuzz_app}/v1/chat/completions", json.dumps(body).encode()))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(raw=st.binary(max_size=300))
def test_raw_bytes_never_get_a_5xx(fuzz_app: str, raw: bytes):
    check(post(f"{fuzz_app}/v1/completions", raw))


embedding_bodies = st.one_of(
    st.fixed_dictionaries(
        {"input": edgy_prompts | st.lists(st.lists(st.integers(-3, 70000), max_size=40), max_size=3)},
        optional={
            "model": st.text(max_size=5),
            "encoding_format": st.sampled_from(["float", "base64", "int8"]),
            "dimensions": st.integers(-2, 1000),
            "user": st.text(max_size=5),
        },
    ),
    st.dictionaries(st.sampled_from(["input", "encoding_format", "dimensions", "user"]), json_values),
    json_values,
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=embedding_bodies)
def test_fuzzed_embeddings_never_get_a_5xx(fuzz_app: str, body: object):
    check(post(f"{fuzz_app}/v1/embeddings", json.dumps(body).encode()))


response_items = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "developer", "robot"]),
            "content": st.text(max_size=30),
        },
    )
    | st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function_call", "function_call_output", "reasoning", "message"]),
            "call_id": st.sampled_from(["call_1", "call_2"]),
        },
        optional={
            "name": st.sampled_from(["f", "bad name"]),
            "arguments": st.sampled_from(["{}", "{", "3"]),
            "output": st.text(max_size=10) | json_values,
        },
    )
    | json_values,
    max_size=4,
)
responses_fields = {
    "instructions": st.text(max_size=20) | json_values,
    "max_output_tokens": st.integers(-2, 40),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_logprobs": st.integers(-2, 25),
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"])),
    "stream": st.booleans(),
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(["function", "web_search"]),
                "name": st.sampled_from(["f", "g", "bad name"]),
            },
            optional={
                "parameters": st.sampled_from([{"type": "object"}, {"type": "frobnicate"}]) | json_values
            },
        ),
        max_size=3,
    ),
    "tool_choice": st.sampled_from(["none", "auto", "required", "always"])
    | st.fixed_dictionaries({"type": st.just("function"), "name": st.text(max_size=3)}),
    "text": st.fixed_dictionaries(
        {
            "format": st.sampled_from([{"type": "json_object"}, {"type": "json_schema", "name": "x"}])
            | json_values
        }
    ),
    "previous_response_id": st.text(max_size=5),
}
responses_bodies = st.one_of(
    st.fixed_dictionaries({"input": st.text(max_size=60) | response_items}, optional=responses_fields),
    st.dictionaries(st.sampled_from(["input", *responses_fields]), json_values, max_size=6),
    json_values,
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=responses_bodies)
def test_fuzzed_responses_never_get_a_5xx(fuzz_app: str, body: object):
    response = post(f"{fuzz_app}/v1/responses", json.dumps(body).encode())
    check(response)
    if response.status_code == 200 and "text/event-stream" in response.headers["content-type"]:
        last = response.text.strip().rsplit("\n\n", 1)[-1]  # a stream ends in its answer, not an error
        assert last.split("\n", 1)[0] in ("event: response.completed", "event: response.incomplete"), last


def test_the_app_serves_normally_after_the_fuzzing(fuzz_app: str):
    response = httpx.post(f"{fuzz_app}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
