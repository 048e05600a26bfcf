"""Tool calls read out of generated text (vLLM's `tool_call_parser`): `hermes`, calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and `llama3_json`, Llama 3.1's bare
`{"name": ..., "parameters": {...}}` objects (separated by `;` when there are several).

One scanner serves both the whole answer and a stream: it reads the text so far into the text
outside calls and the calls, each with its name (once complete) and the raw JSON of its arguments
so far. As the text grows, both only ever grow, so a stream sends differences and its pieces join
up to the whole answer. Arguments are the model's own JSON text, not re-serialized."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from common.stream_text import held_back

_WHITESPACE = " \t\n\r"
_SCALAR_END = ",}]" + _WHITESPACE


@dataclass(frozen=True)
class CallFormat:
    start: str  # the text a call begins with
    end: str  # after its JSON object ("" for none)
    arguments_keys: tuple[str, ...]  # the member holding the arguments
    separator: str  # between calls, not part of the answer's text
    object_inside: bool  # the JSON object comes after `start` (else `start` opens the object)


FORMATS = {
    "hermes": CallFormat("<tool_call>", "</tool_call>", ("arguments",), "", object_inside=True),
    "llama3_json": CallFormat('{"name"', "", ("parameters", "arguments"), ";", object_inside=False),
}


@dataclass
class Call:
    name: str | None  # None until the name's string is complete
    arguments: str  # the raw JSON of the arguments so far


@dataclass
class Parsed:
    content: str  # the text outside calls
    calls: list[Call]


def _skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value starting at text[i], or None if the text ends first."""
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if text[i] in "{[":
        depth, j, in_string = 0, i, False
        while j < len(text):
            char = text[j]
            if in_string:
                if char == "\\":
                    j += 1
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _SCALAR_END:
        j += 1
    return j if j < len(text) else None


def _read_call(text: str, i: int, keys: tuple[str, ...]) -> tuple[Call | None, int | None]:
    """The call whose JSON object starts at text[i]: (the call so far, the index past the object,
    None while it is incomplete). (None, None): not a call's object."""
    name: str | None = None
    arguments, j = "", i + 1
    while True:
        j = _skip_whitespace(text, j)
        if j >= len(text):
            return Call(name, arguments), None
        if text[j] == "}":  # a call without arguments takes none; an object without a name is none
            return (Call(name, arguments or "{}"), j + 1) if name is not None else (None, None)
        key_end = _value_end(text, j) if text[j] == '"' else -1
        if key_end == -1:
            return None, None
        if key_end is None:
            return Call(name, arguments), None
        key = _json_value(text[j:key_end])
        j = _skip_whitespace(text, key_end)
        if j >= len(text):
            return Call(name, arguments), None
        if text[j] != ":":
            return None, None
        j = _skip_whitespace(text, j + 1)
        if j >= len(text):
            return Call(name, arguments), None
        value_end = _value_end(text, j)
        if key in keys:
            arguments = text[j : len(text) if value_end is None else value_end]
        if value_end is None:
            return Call(name, arguments), None
        if key == "name":
            value = _json_value(text[j:value_end])
            if not isinstance(value, str):
                return None, None
            name = value
        j = _skip_whitespace(text, value_end)
        if j < len(text) and text[j] == ",":
            j += 1
        elif j < len(text) and text[j] != "}":
            return None, None


def _json_value(text: str) -> object:
    """A complete JSON value, or None where it is not JSON (a string with a bad escape): the
    scanner only delimits values, so reading one may still fail, and that is no call."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse(text: str, format_name: str, final: bool) -> Parsed:
    """The text's calls and the text around them. Not `final`: the text may go on, so a tail that
    could begin a call is held back (in neither part)."""
    fmt = FORMATS[format_name]
    content: list[str] = []
    calls: list[Call] = []
    i = 0
    while i < len(text):
        at = text.find(fmt.start, i)
        if at < 0:
            tail = text[i:]
            content.append(tail if final else tail[: len(tail) - held_back(tail, fmt.start)])
            break
        content.append(text[i:at])
        object_at = _skip_whitespace(text, at + len(fmt.start)) if fmt.object_inside else at
        if object_at >= len(text):
            break  # a call begun, its object not yet
        call, end = (
            (None, None) if text[object_at] != "{" else _read_call(text, object_at, fmt.arguments_keys)
        )
        if call is None:  # not a call after all: its start is text
            content.append(fmt.start)
            i = at + len(fmt.start)
            continue
        calls.append(call)
        if end is None:
            break
        i = _skip_whitespace(text, end)
        if fmt.end:
            if text.startswith(fmt.end, i):
                i += len(fmt.end)
            elif fmt.end.startswith(text[i:]):
                break  # its closing tag is on its way, or was cut short (max_tokens): no text
        if fmt.separator:
            after = _skip_whitespace(text, i)
            if text.startswith(fmt.separator, after):
                i = after + len(fmt.separator)
    return Parsed("".join(content), calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_body(call_id: str, call: Call) -> dict[str, object]:
    """OpenAI's `tool_calls` item."""
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass(frozen=True)
class Message:
    """An answer's text and calls, as OpenAI's assistant message has them."""

    content: str | None
    tool_calls: list[dict[str, object]]


def parse_message(text: str, format_name: str) -> Message:
    """The whole answer: its calls and the text outside them. A call cut short by max_tokens is
    sent as far as it got once its name is known (its arguments' JSON unfinished, as OpenAI's
    API sends them, and as a stream has sent them); its tag is never text."""
    parsed = parse(text, format_name, final=True)
    calls = [tool_call_body(new_call_id(), call) for call in parsed.calls if call.name is not None]
    return Message(parsed.content.strip() or None, calls)


@dataclass
class StreamedMessage:
    """One choice's answer as a stream: feed it each new piece of text, get what is new. Whitespace
    waits for the text after it (the whole answer is stripped); a call is sent once its name is
    known, with its arguments as they grow."""

    format_name: str
    _text: str = ""
    _content_sent: int = 0
    _ids: list[str] = field(default_factory=list)
    _arguments_sent: list[int] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, object]]]:
        """(new text, new `tool_calls` deltas: index, then id, type and name once, arguments pieces)."""
        self._text += delta
        parsed = parse(self._text, self.format_name, final)
        content = parsed.content.strip()
        new_content = content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(content))
        deltas: list[dict[str, object]] = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # calls are sent in order
            piece: dict[str, object] = {"index": index}
            function: dict[str, object] = {}
            if index == len(self._ids):
                self._ids.append(new_call_id())
                self._arguments_sent.append(0)
                piece.update(id=self._ids[index], type="function")
                function["name"] = call.name
            new_arguments = call.arguments[self._arguments_sent[index] :]
            if new_arguments or function:
                function["arguments"] = new_arguments
                self._arguments_sent[index] = len(call.arguments)
                deltas.append({**piece, "function": function})
        return new_content, deltas

    @property
    def has_calls(self) -> bool:
        return bool(self._ids)
