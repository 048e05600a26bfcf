"""OpenAI's Responses API, the answer side: a chat completion's body (whole) or chunks (streamed),
as deployments/responses.py writes them, rewritten as a Response object and its typed events.
The chat side has already read out the reasoning and the tool calls; here they become output
items: a reasoning item, a message with one output_text part, and a function_call per call."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from deployments.protocol import ApiError
from deployments.responses_api import ResponsesRequest

Item = dict[str, Any]


@dataclass
class ResponseShape:
    """One Responses request's answer: its envelope (the request's settings echoed, as OpenAI
    does), and the chat answer rewritten into it."""

    request: ResponsesRequest
    request_id: str
    model: str
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[Item], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        request = self.request
        text_format = request.text.format if request.text and request.text.format else None
        choice = request.tool_choice
        return {
            "id": f"resp_{self.request_id}",
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": None,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in request.function_tools()],
            "text": {"format": text_format.model_dump(by_alias=True) if text_format else {"type": "text"}},
            "store": False,  # nothing is kept (module docstring of responses_api)
            "truncation": "disabled",
            "usage": usage,
        }

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A chat completion body (one choice) as a Response."""
        choice = chat["choices"][0]
        message = choice["message"]
        status = _status(choice["finish_reason"])
        output: list[Item] = []
        if message.get("reasoning_content"):
            output.append(_reasoning(self.item_id("rs", 0), message["reasoning_content"], status))
        if message.get("content"):
            logprobs = _text_logprobs((choice.get("logprobs") or {}).get("content") or [], message["content"])
            output.append(_message(self.item_id("msg", len(output)), message["content"], logprobs, status))
        for call in message.get("tool_calls") or ():
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            output.append(_call(self.item_id("fc", len(output)), call["id"], name, arguments, status))
        return self.body(status, output, _usage(chat["usage"]))

    def item_id(self, prefix: str, output_index: int) -> str:
        return f"{prefix}_{self.request_id}_{output_index}"


def _text_logprobs(logprobs: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The logprobs of the tokens that make up `text`: without the trailing ones whose text is
    not in it (the end-of-text token, a stop string's tokens), as a stream leaves them out (their
    logprobs wait for text that never comes)."""
    kept = len(logprobs)
    while kept and len("".join(entry["token"] for entry in logprobs[: kept - 1])) >= len(text):
        kept -= 1
    return logprobs[:kept]


def _reasoning(item_id: str, text: str, status: str) -> Item:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _message(item_id: str, text: str, logprobs: list[dict[str, Any]], status: str) -> Item:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [part]}


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Item:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,  # OpenAI's explicit cache writes (prompt_cache_options): none here
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},  # not counted apart from the answer's
        "total_tokens": chat_usage["total_tokens"],
    }


@dataclass
class _OpenItem:
    """The output item the stream is writing: its kind, place and what it has so far."""

    kind: str  # rs (reasoning) | msg (message) | fc (function call)
    output_index: int
    item_id: str
    text: str = ""  # reasoning or answer text; a call's arguments
    call: tuple[str, str] = ("", "")  # a call's (call_id, name)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def item(self, status: str) -> Item:
        if self.kind == "fc":
            return _call(self.item_id, *self.call, self.text, status)
        if self.kind == "rs":
            return _reasoning(self.item_id, self.text, status)
        return _message(self.item_id, self.text, self.logprobs, status)

    @property
    def where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": self.output_index}

    @property
    def part_at(self) -> dict[str, Any]:
        """Where its one content part is (a reasoning item's or a message's)."""
        return {**self.where, "content_index": 0}


class ResponseStream:
    """One streamed answer's events: the items opened and closed as the chat chunks' deltas go
    from reasoning to text to tool calls, each event numbered (sequence_number)."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence_number = 0
        self.output: list[Item] = []
        self.open: _OpenItem | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        # Of tokens whose text is not out yet; those whose text never comes (the end-of-text
        # token, a stop string's) are left out, as _text_logprobs leaves them out of a whole answer.
        self.pending_logprobs: list[dict[str, Any]] = []

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        """Chat completion chunks (with a final usage chunk) as the Responses stream's events."""
        yield self._event("response.created", response=self.shape.body("in_progress", []))
        yield self._event("response.in_progress", response=self.shape.body("in_progress", []))
        async for chunk in chunks:
            for event in self._feed(chunk):
                yield event
        status = _status(self.finish_reason)
        for event in self._close(status):
            yield event
        final = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self._event(final, response=self.shape.body(status, self.output, self.usage))

    def error(self, error: ApiError) -> str:
        """A failure after the stream began: OpenAI's `error` event."""
        body = error.body["error"]
        return self._event("error", code=body["code"], message=body["message"], param=body["param"])

    def _event(self, event_type: str, **fields: Any) -> str:
        body = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {event_type}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _feed(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        events: list[str] = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            self.pending_logprobs += (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning_content"):
                events += self._write("rs", delta["reasoning_content"])
            if delta.get("content"):
                events += self._write("msg", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._write_call(call)
            self.finish_reason = choice["finish_reason"] or self.finish_reason
        return events

    def _write(self, kind: str, text: str) -> list[str]:
        events = [] if self.open is not None and self.open.kind == kind else self._open(kind)
        item = self.open
        assert item is not None
        item.text += text
        if kind == "rs":
            return [
                *events,
                self._event("response.reasoning_text.delta", **item.part_at, delta=text),
            ]
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        item.logprobs += logprobs
        delta = self._event("response.output_text.delta", **item.part_at, delta=text, logprobs=logprobs)
        return [*events, delta]

    def _write_call(self, call: dict[str, Any]) -> list[str]:
        """A tool call's delta: its first (with the call's id) names it, a new function_call
        item; the rest add to its arguments."""
        function = call.get("function") or {}
        events = self._open("fc", (call["id"], function["name"])) if "id" in call else []
        item = self.open
        assert item is not None and item.kind == "fc"
        arguments = function.get("arguments") or ""
        if arguments:
            item.text += arguments
            events.append(
                self._event("response.function_call_arguments.delta", **item.where, delta=arguments)
            )
        return events

    def _open(self, kind: str, call: tuple[str, str] = ("", "")) -> list[str]:
        events = self._close("completed")
        index = len(self.output)
        self.open = item = _OpenItem(kind, index, self.shape.item_id(kind, index), call=call)
        added = item.item("in_progress")
        if kind == "fc":
            return [*events, self._event("response.output_item.added", output_index=index, item=added)]
        added["content"] = []
        part = _part(kind)
        return [
            *events,
            self._event("response.output_item.added", output_index=index, item=added),
            self._event("response.content_part.added", **item.part_at, part=part),
        ]

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        if item.kind == "msg":  # a text delta may have carried the end-of-text token's logprob too
            item.logprobs = _text_logprobs(item.logprobs, item.text)
        done = item.item(status)
        self.output.append(done)
        if item.kind == "fc":
            ending = [self._event("response.function_call_arguments.done", **item.where, arguments=item.text)]
        else:
            text_done = "response.reasoning_text.done" if item.kind == "rs" else "response.output_text.done"
            logprobs = {} if item.kind == "rs" else {"logprobs": item.logprobs}
            ending = [
                self._event(text_done, **item.part_at, text=item.text, **logprobs),
                self._event("response.content_part.done", **item.part_at, part=done["content"][0]),
            ]
        done_event = self._event("response.output_item.done", output_index=item.output_index, item=done)
        return [*ending, done_event]


def _part(kind: str) -> dict[str, Any]:
    if kind == "rs":
        return {"type": "reasoning_text", "text": ""}
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
