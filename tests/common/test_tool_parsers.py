"""Tool-call parsers on fixed texts (no model): whole answers, and streams that must join up to
the whole answer whatever the pieces' sizes."""

from __future__ import annotations

import json

import pytest

from common.tool_parsers import Message, StreamedMessage, parse_message

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"note": "} ]"}]}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": -2.5e3}}'
HERMES_TWO = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>"


def functions(calls: list[dict]) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_reads_several_calls_and_the_text_before_them():
    message = parse_message(HERMES_TWO, "hermes")
    assert message.content == "Let me check."
    assert functions(message.tool_calls) == [
        ("get_weather", {"city": "Paris", "days": [1, {"note": "} ]"}]}),
        ("add", {"a": 1, "b": -2500.0}),
    ]
    ids = [call["id"] for call in message.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert all(call["type"] == "function" for call in message.tool_calls)


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_hermes_reads_calls_side_by_side(piece: int):
    """As a required tool_choice's grammar writes them (no text between calls)."""
    text = f"<tool_call>\n{WEATHER}\n</tool_call><tool_call>\n{ADD}\n</tool_call>"
    message = parse_message(text, "hermes")
    assert message.content is None and [name for name, _ in functions(message.tool_calls)] == [
        "get_weather",
        "add",
    ]
    content, calls = streamed(text, "hermes", piece=piece)
    assert content == "" and functions(calls) == functions(message.tool_calls)


def test_arguments_are_the_models_own_json_text():
    text = '<tool_call>\n{"name": "f", "arguments": {\n  "x": "é"\n}}\n</tool_call>'
    assert parse_message(text, "hermes").tool_calls[0]["function"]["arguments"] == '{\n  "x": "é"\n}'


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris.",
        "<tool_call>\n{}\n</tool_call>",  # an object without a name
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',  # a name that is no string
        "<tool_call> not json </tool_call>",
        '<tool_call>\n{"name": "a\\q", "arguments": {}}\n</tool_call>',  # a bad escape: not JSON
    ],
)
def test_text_that_holds_no_call_is_all_content(text: str):
    message = parse_message(text, "hermes")
    assert message.tool_calls == [] and message.content == text.strip()


@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        ('Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1', '{"a": 1'),  # in its arguments
        ('Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool', '{"a": 1}'),  # its closing tag
    ],
)
def test_a_call_cut_short_by_max_tokens_leaves_no_tag_text(text: str, arguments: str):
    message = parse_message(text, "hermes")
    assert message.content == "Sure."
    assert [c["function"] for c in message.tool_calls] == [{"name": "add", "arguments": arguments}]
    content, calls = streamed(text, "hermes", piece=3)
    assert content == "Sure." and [c["function"] for c in calls] == [
        c["function"] for c in message.tool_calls
    ]
    assert parse_message('Sure.<tool_call>\n{"na', "hermes") == Message("Sure.", [])  # no name yet: no call


def test_a_call_without_arguments_takes_none_and_a_missing_closing_tag_is_forgiven():
    message = parse_message('<tool_call>\n{"name": "now"}', "hermes")
    assert functions(message.tool_calls) == [("now", {})] and message.content is None


def test_llama3_json_reads_parameters_and_calls_separated_by_semicolons():
    text = '{"name": "add", "parameters": {"a": 1}}; {"name": "now", "parameters": {}}'
    message = parse_message(text, "llama3_json")
    assert functions(message.tool_calls) == [("add", {"a": 1}), ("now", {})] and message.content is None
    assert parse_message('{"answer": 4}', "llama3_json").tool_calls == []


def streamed(text: str, format_name: str, piece: int) -> tuple[str, list[dict]]:
    """The stream's text and calls, joined as a client joins deltas."""
    stream, content, calls = StreamedMessage(format_name), "", {}
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for k, delta in enumerate(pieces):
        new, deltas = stream.feed(delta, final=k == len(pieces) - 1)
        content += new
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls) and "name" in d["function"]  # a call opens with its name
                calls[d["index"]] = {
                    "id": d["id"],
                    "function": {"name": d["function"]["name"], "arguments": ""},
                }
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return content, list(calls.values())


@pytest.mark.parametrize("piece", [1, 2, 5, 13, 1000])
@pytest.mark.parametrize(
    ("text", "format_name"),
    [
        (HERMES_TWO, "hermes"),
        ("  Just text, <b>with</b> a tag.\n", "hermes"),
        (f"<tool_call>\n{ADD}\n</tool_call>\n\nDone.", "hermes"),
        ('{"name": "add", "parameters": {"a": 1}}; {"name": "now", "parameters": {}}', "llama3_json"),
    ],
)
def test_a_stream_joins_up_to_the_whole_answer(text: str, format_name: str, piece: int):
    whole = parse_message(text, format_name)
    content, calls = streamed(text, format_name, piece)
    assert (content or None) == whole.content
    assert [c["function"] for c in calls] == [c["function"] for c in whole.tool_calls]


def test_a_stream_sends_a_call_before_its_arguments_are_complete():
    stream = StreamedMessage("hermes")
    _, deltas = stream.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1', final=False)
    assert deltas == [
        {
            "index": 0,
            "id": deltas[0]["id"],
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1'},
        }
    ]
    _, deltas = stream.feed(', "b": 2}}\n</tool_call>', final=True)
    assert deltas == [{"index": 0, "function": {"arguments": ', "b": 2}'}}] and stream.has_calls
