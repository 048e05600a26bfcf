"""A reasoning parser in the API's answers (no model, no Ray: the Ingress's response writer fed
fixed deltas): the reasoning goes to `reasoning_content`, the rest to `content` or to the tool
calls read after it, whole and streamed alike; `include_reasoning: false` drops it; and the app
setting reaches the Ingress, naming a bad value."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from common.finish_reason import FinishReason
from common.messages import ChoiceDelta
from deployments.app_args import AppArgs
from deployments.responses import CHAT, ResponseWriter, ToolCallReading, Usage

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
THINKING = "<think>\nAdd them.\n</think>\n\n"


def writer(include_reasoning: bool = True, tools: bool = False) -> ResponseWriter:
    reading = ToolCallReading("hermes") if tools else None
    return ResponseWriter(
        CHAT,
        "r",
        "m",
        Usage(1),
        tool_calls=reading,
        reasoning_parser="qwen3",
        include_reasoning=include_reasoning,
    )


async def deltas(text: str, piece: int) -> AsyncIterator[list[ChoiceDelta]]:
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for k, part in enumerate(pieces):
        finish = FinishReason.STOP if k == len(pieces) - 1 else None
        yield [ChoiceDelta(0, part, [k], num_prompt_tokens=3, finish_reason=finish)]


def whole(text: str, **settings: bool) -> dict:
    return asyncio.run(writer(**settings).whole(deltas(text, 1000)))["choices"][0]


def streamed(text: str, piece: int, **settings: bool) -> tuple[dict, str | None]:
    """The stream's message, joined as a client joins deltas, and its finish reason."""

    async def join() -> tuple[dict, str | None]:
        joined: dict = {"reasoning_content": "", "content": "", "tool_calls": {}}
        finish = None
        async for event in writer(**settings).events(deltas(text, piece)):
            if event.startswith("data: {"):
                choice = json.loads(event.removeprefix("data: "))["choices"][0]
                delta, finish = choice["delta"], choice["finish_reason"] or finish
                joined["reasoning_content"] += delta.get("reasoning_content") or ""
                joined["content"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or ():
                    name = call["function"].get("name")
                    joined["tool_calls"].setdefault(call["index"], [name, ""])[1] += call["function"][
                        "arguments"
                    ]
        return joined, finish

    return asyncio.run(join())


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_reasoning_then_content_whole_and_streamed(piece: int):
    choice = whole(THINKING + "It is 2.")
    assert choice["message"]["reasoning_content"] == "Add them."
    assert choice["message"]["content"] == "It is 2." and choice["finish_reason"] == "stop"
    message, finish = streamed(THINKING + "It is 2.", piece)
    assert (message["reasoning_content"], message["content"], finish) == ("Add them.", "It is 2.", "stop")


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_tool_calls_are_read_after_the_reasoning(piece: int):
    choice = whole(THINKING + CALL, tools=True)
    assert choice["message"]["reasoning_content"] == "Add them." and choice["message"]["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("add", '{"a": 1}')
    ]
    assert choice["finish_reason"] == "tool_calls"
    message, finish = streamed(THINKING + CALL, piece, tools=True)
    assert message["reasoning_content"] == "Add them." and message["content"] == ""
    assert list(message["tool_calls"].values()) == [["add", '{"a": 1}']] and finish == "tool_calls"


def test_include_reasoning_false_drops_it_from_the_answer():
    message = whole(THINKING + "It is 2.", include_reasoning=False)["message"]
    assert "reasoning_content" not in message and message["content"] == "It is 2."
    joined, _ = streamed(THINKING + "It is 2.", 3, include_reasoning=False)
    assert (joined["reasoning_content"], joined["content"]) == ("", "It is 2.")


def test_the_setting_names_a_bad_parser():
    assert AppArgs(reasoning_parser="deepseek_r1").reasoning_parser == "deepseek_r1"
    with pytest.raises(ValidationError, match="reasoning_parser"):
        AppArgs(reasoning_parser="qwen")
