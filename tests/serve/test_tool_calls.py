"""Tool calling through the real app (serve_config.yaml, SmolLM2, the hermes parser and our ChatML
tools template) with the official `openai` client, as an agent loop calls it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from harness.serve_cluster import ServeCluster
from harness.tool_schemas import MODELS, NO_TOOL_PROMPT, NONSENSE_TOOL, PROMPTS, call_problem, tools

MODEL = "smollm2-135m-instruct"
DEADLINE_S = 1800  # a hang detector: twenty constrained requests beside busy processes take minutes


TOOLS = tools()


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{serve_cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S
    )


def ask(client: openai.OpenAI, prompt: str, **fields: object) -> openai.types.chat.ChatCompletion:
    fields = {"tools": TOOLS, "temperature": 0, "max_tokens": 300, **fields}
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], **fields
    )


def check_calls(message: openai.types.chat.ChatCompletionMessage) -> None:
    """Every call names a tool and its arguments validate against that tool's schema."""
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call_problem(call.function.name, call.function.arguments) is None, call


def test_required_and_named_calls_always_follow_the_tools_schemas(client: openai.OpenAI):
    cases = [(prompt, "required", parallel) for prompt in PROMPTS for parallel in (True, False)]
    cases += [(prompt, name, True) for prompt in PROMPTS for name in MODELS]  # 20 requests in all
    choices = {name: {"type": "function", "function": {"name": name}} for name in MODELS}

    def one(case: tuple[str, str, bool]) -> tuple[str, bool, openai.types.chat.ChatCompletion]:
        prompt, choice, parallel = case
        return (
            choice,
            parallel,
            ask(client, prompt, tool_choice=choices.get(choice, choice), parallel_tool_calls=parallel),
        )

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(one, cases))
    for choice, parallel, answer in answers:
        message = answer.choices[0].message
        # a named tool_choice finishes with stop, as OpenAI's API and vLLM answer it
        assert answer.choices[0].finish_reason == ("stop" if choice in MODELS else "tool_calls"), message
        check_calls(message)
        assert message.content is None
        if choice in MODELS:
            assert [call.function.name for call in message.tool_calls] == [choice]
        if not parallel:
            assert len(message.tool_calls) == 1


def test_the_tool_result_sent_back_gets_an_answer(client: openai.OpenAI):
    prompt = PROMPTS[1]
    first = ask(client, prompt, tool_choice="required").choices[0].message
    check_calls(first)
    history = [
        {"role": "user", "content": prompt},
        first.model_dump(exclude_none=True),  # content null, tool_calls: as the client sends it back
        *(
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}
            for call in first.tool_calls
        ),
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=60
    )
    choice = final.choices[0]
    if choice.message.tool_calls:  # auto: the model may call again, but only validly
        check_calls(choice.message)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_auto_answers_in_text_or_in_valid_calls_never_a_half_call(client: openai.OpenAI):
    prompts = [*PROMPTS, NO_TOOL_PROMPT]
    with ThreadPoolExecutor(len(prompts)) as pool:  # all at once: the engine batches them
        answers = list(pool.map(lambda prompt: ask(client, prompt), prompts))
    for answer in answers:
        choice = answer.choices[0]
        if choice.message.tool_calls:
            check_calls(choice.message)
            assert choice.finish_reason == "tool_calls"
        else:
            assert choice.message.content and "<tool_call>" not in choice.message.content


def streamed(client: openai.OpenAI, prompt: str, **fields: object) -> tuple[str | None, list, str]:
    """The streamed answer joined as the openai client's users join it."""
    content, calls, finish = "", {}, ""
    fields = {"tools": TOOLS, "temperature": 0, "max_tokens": 300, **fields}
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, **fields
    )
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            if piece.id:
                assert piece.function.name and piece.index not in calls  # the name comes first, once
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(call) for _, call in sorted(calls.items())], finish


@pytest.mark.parametrize(
    ("prompt", "fields"),
    [(PROMPTS[2], {"tool_choice": "required"}), (NO_TOOL_PROMPT, {}), (PROMPTS[0], {"max_tokens": 30})],
)
def test_streamed_tool_calls_join_up_to_the_whole_answer(client: openai.OpenAI, prompt: str, fields: dict):
    whole = ask(client, prompt, **fields).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert streamed(client, prompt, **fields) == (whole.message.content, calls, whole.finish_reason)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": [NONSENSE_TOOL]},
            "tools",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "Fly"}}}, "tool_choice"),
        ({"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "18 C"}]}, "messages"),
    ],
)
def test_bad_tools_get_a_400_naming_the_field(serve_cluster: ServeCluster, fields: dict, param: str):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, **fields}
    response = httpx.post(f"{serve_cluster.base_url}/v1/chat/completions", json=body, timeout=DEADLINE_S)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
