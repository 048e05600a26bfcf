"""A chat request's tools without a server: the checks (each a 400 naming its field), the grammar a
request gets, and the conversation as the template renders it, against transformers'
apply_chat_template with the same template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import InvalidRequestError
from common.model_source import DEFAULT_MODEL, resolve_model
from common.prompts import PromptProcessor
from common.tokenizer import CHATML_TOOLS_TEMPLATE
from deployments.chat_tools import NO_PARAMETERS
from deployments.protocol import ApiError, ChatCompletionRequest, parse_body

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def request(**fields: object) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse_body(ChatCompletionRequest, json.dumps(body).encode())


def refusal(**fields: object) -> tuple[str | None, str]:
    """(param, message) of the 400 the request gets, wherever it is checked."""
    try:
        body = request(**fields)
        body.conversation()
        body.sampling({}, "hermes")
    except ApiError as error:
        return error.body["error"]["param"], error.body["error"]["message"]
    except InvalidRequestError as error:
        return error.param, str(error)
    raise AssertionError("accepted")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [{"role": "tool", "tool_call_id": "call_9", "content": "18 C"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages"),
        ({"messages": [{"role": "user", "content": None}]}, "messages"),
        ({"messages": [{"role": "user", "content": "Hi", "tool_calls": [CALL]}]}, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_tools_are_refused_naming_the_field(fields: dict, param: str):
    assert refusal(**fields)[0] == param


def test_the_grammar_follows_tool_choice():
    assert "structured_outputs" not in request(tools=[WEATHER], tool_choice="none").sampling({}, "hermes")
    auto = request(tools=[WEATHER]).sampling({}, "hermes")["structured_outputs"].tool_calls
    assert (auto.mode, auto.format, auto.parallel) == ("auto", "hermes", True)
    now = {"type": "function", "function": {"name": "now"}}  # no parameters: it takes none
    named = (
        request(
            tools=[WEATHER, now],
            tool_choice={"type": "function", "function": {"name": "now"}},
            parallel_tool_calls=False,
        )
        .sampling({}, "llama3_json")["structured_outputs"]
        .tool_calls
    )
    assert (named.mode, named.format, named.parallel) == ("named", "llama3_json", False)
    assert json.loads(named.tools) == [{"name": "now", "parameters": NO_PARAMETERS}]
    with pytest.raises(InvalidRequestError, match="tool_call_parser"):
        request(tools=[WEATHER]).sampling({}, None)


@pytest.fixture(scope="module")
def prompts() -> PromptProcessor:
    return PromptProcessor.load(resolve_model(DEFAULT_MODEL))


def test_tools_and_tool_history_render_as_transformers_renders_them(prompts: PromptProcessor):
    from transformers import AutoTokenizer

    body = parse_body(ChatCompletionRequest, json.dumps({"messages": HISTORY, "tools": [WEATHER]}).encode())
    ours = prompts.chat_text(body.conversation(), tools=body.template_tools())
    hf = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL).hf_dir)
    template = CHATML_TOOLS_TEMPLATE.read_text()
    call_as_object = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = [{**m, "tool_calls": [call_as_object]} if m.get("tool_calls") else m for m in HISTORY]
    theirs = hf.apply_chat_template(
        history, tools=[WEATHER], chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in ours and "<tool_response>\n18 C" in ours
    # without tools, the model's own template, as before
    assert prompts.chat_text([{"role": "user", "content": "Hi"}]).startswith("<|im_start|>system\nYou are")


def test_a_chat_template_setting_is_a_file_or_a_template(tmp_path: Path, prompts: PromptProcessor):
    source = resolve_model(DEFAULT_MODEL)
    inline = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert (
        PromptProcessor.load(source, chat_template=inline).chat_text(HISTORY[:1])
        == "[user] Weather in Paris?\n"
    )
    path = tmp_path / "template.jinja"
    path.write_text(inline)
    assert (
        PromptProcessor.load(source, chat_template=str(path)).chat_text(HISTORY[:1])
        == "[user] Weather in Paris?\n"
    )
    with pytest.raises(InvalidRequestError) as raised:
        PromptProcessor.load(source, chat_template="no/such/file.jinja")
    assert raised.value.param == "chat_template"
    # a template that renders no tools, for a model that is not ChatML: requests with tools are refused
    with pytest.raises(InvalidRequestError) as raised:
        PromptProcessor.load(source, chat_template=inline).chat_text(HISTORY[:1], tools=[WEATHER])
    assert raised.value.param == "tools"


def test_chat_template_kwargs_reach_the_template():
    """vLLM's chat_template_kwargs (e.g. Qwen3's enable_thinking): more variables for the template;
    the ones the server sets itself are refused, naming the field."""
    thinking = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    )
    processor = PromptProcessor.load(resolve_model(DEFAULT_MODEL), chat_template=thinking)
    assert processor.chat_text(HISTORY[:1]) == "Weather in Paris?"
    assert (
        processor.chat_text(HISTORY[:1], template_kwargs={"enable_thinking": False})
        == "Weather in Paris?<no-think>"
    )
    with pytest.raises(InvalidRequestError) as raised:
        processor.chat_text(HISTORY[:1], template_kwargs={"messages": []})
    assert raised.value.param == "chat_template_kwargs"
    assert request(chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs == {
        "enable_thinking": False
    }
