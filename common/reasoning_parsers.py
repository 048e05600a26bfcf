"""Reasoning read out of generated text (vLLM's `reasoning_parser`): models that think inside
`<think>...</think>` before they answer. `qwen3`: the answer thinks only where it opens with
`<think>` (Qwen3 with `enable_thinking: false` answers without one); `deepseek_r1`: its chat
template opens `<think>` in the prompt, so the answer starts inside it. An answer cut short
while thinking (max_tokens) is all reasoning.

As tool_parsers does, one reading serves the whole answer and a stream: the reasoning and the
content of the text so far only ever grow, so a stream sends differences; whitespace around the
reasoning, and before the content, waits for the text after it."""

from __future__ import annotations

from dataclasses import dataclass

from common.stream_text import held_back

START, END = "<think>", "</think>"
PARSERS = {"qwen3": False, "deepseek_r1": True}  # name -> the answer starts inside <think>


def split_reasoning(text: str, parser: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) of the text so far. Not `final`: the text may go on, so a tail that
    could begin a tag is held back (in neither part)."""
    opened = text.lstrip()
    if not final and START.startswith(opened):
        return "", ""  # `<think>` may be on its way
    if opened.startswith(START):
        body = opened[len(START) :]
    elif PARSERS[parser]:
        body = text
    else:
        return "", text
    end = body.find(END)
    if end >= 0:
        return body[:end].strip(), body[end + len(END) :].lstrip()
    if final:
        return body.strip(), ""
    return body[: len(body) - held_back(body, END)].strip(), ""


@dataclass
class StreamedReasoning:
    """One choice's answer as a stream: feed it each new piece of text, get its new reasoning and
    its new content."""

    parser: str
    _text: str = ""
    _reasoning_sent: int = 0
    _content_sent: int = 0

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self._text += delta
        reasoning, content = split_reasoning(self._text, self.parser, final)
        new_reasoning, new_content = reasoning[self._reasoning_sent :], content[self._content_sent :]
        self._reasoning_sent = max(self._reasoning_sent, len(reasoning))
        self._content_sent = max(self._content_sent, len(content))
        return new_reasoning, new_content
