"""Reasoning parsers on fixed texts (no model): whole answers, and streams that must join up to
the whole answer whatever the pieces' sizes."""

from __future__ import annotations

import pytest

from common.reasoning_parsers import StreamedReasoning, split_reasoning

THOUGHT = "<think>\nThe user wants 2 + 2.\nThat is 4.\n</think>\n\nIt is 4."


@pytest.mark.parametrize(
    ("text", "parser", "reasoning", "content"),
    [
        (THOUGHT, "qwen3", "The user wants 2 + 2.\nThat is 4.", "It is 4."),
        (THOUGHT, "deepseek_r1", "The user wants 2 + 2.\nThat is 4.", "It is 4."),
        ("It is 4.", "qwen3", "", "It is 4."),  # thinking off: no <think>
        ("Easy.\n</think>\n\nIt is 4.", "deepseek_r1", "Easy.", "It is 4."),  # the prompt opened it
        ("<think>\nThe user wants", "qwen3", "The user wants", ""),  # cut short while thinking
        ("The user wants", "deepseek_r1", "The user wants", ""),
        ("<thi", "qwen3", "", "<thi"),  # text, once the answer has ended
    ],
)
def test_reasoning_and_content_of_a_whole_answer(text: str, parser: str, reasoning: str, content: str):
    assert split_reasoning(text, parser, final=True) == (reasoning, content)


def streamed(text: str, parser: str, piece: int) -> tuple[str, str]:
    stream, reasoning, content = StreamedReasoning(parser), "", ""
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for k, delta in enumerate(pieces):
        new_reasoning, new_content = stream.feed(delta, final=k == len(pieces) - 1)
        reasoning, content = reasoning + new_reasoning, content + new_content
    return reasoning, content


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize(
    "text",
    [
        THOUGHT,
        "It is 4.",
        "Easy.\n</think>\n\nIt is 4.",
        "<think>\nThe user wants",
        "<thi",
        " <think>a</thinker",
    ],
)
def test_a_stream_joins_up_to_the_whole_answer(text: str, parser: str, piece: int):
    assert streamed(text, parser, piece) == split_reasoning(text, parser, final=True)


def test_a_stream_holds_back_what_may_begin_a_tag():
    stream = StreamedReasoning("qwen3")
    assert stream.feed("<thi", final=False) == ("", "")
    assert stream.feed("nk>Hm, 2 + 2 </th", final=False) == ("Hm, 2 + 2", "")
    assert stream.feed("ink> 4", final=True) == ("", "4")
