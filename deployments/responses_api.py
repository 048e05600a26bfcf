"""OpenAI's Responses API (`POST /v1/responses`), the request side: its body, and the chat
completion request it is answered as. Input items become chat messages (a function call joins the
assistant message before it; a call's output is a tool message), `instructions` the system message,
function tools the chat's tools, `text.format` the response_format. The answer is written back in
the Responses shapes by deployments/responses_output.py.

Not kept: a response is not stored, so `previous_response_id` is refused (send the whole input, as
a client does with `store: false`); only function tools run here (hosted tools are OpenAI's)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.errors import InvalidRequestError
from common.sampling_params import MAX_LOGPROBS
from deployments.protocol import ApiError, ChatCompletionRequest, parse_body

LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for output logprobs


class ContentPart(BaseModel):
    """A message's text part: input_text (a user's), output_text (an earlier answer's)."""

    model_config = ConfigDict(extra="ignore")  # annotations, logprobs of an earlier answer

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status, phase

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return _text(self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(BaseModel):
    """An earlier answer's reasoning, sent back by clients that replay the whole output: dropped,
    as chat templates drop the thinking of earlier turns."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # verbosity

    format: TextFormat | None = None


# What a wrong field of the chat request it becomes is called here.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}


class ResponsesRequest(BaseModel):
    # What a client may send and nothing here acts on (store, truncation, service_tier, reasoning,
    # prompt_cache_key, ...) is accepted and left out.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # checked one by one: hosted tools get their own 400
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    text: TextConfig | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    user: str | None = None
    seed: int | None = None  # vLLM's, as are the sampling extensions below
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise ApiError(400, f"tools.{i}: only function tools run here", param="tools")
            tools.append(FunctionTool.model_validate(tool))
        return tools

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS in (self.include or ())

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request this is answered as; its checks name the chat fields, which
        `renamed_params` renames to this body's."""
        if self.previous_response_id is not None:
            raise ApiError(
                400,
                "previous_response_id: responses are not stored here; send the whole conversation as input",
                param="previous_response_id",
            )
        messages = self._messages()
        if not messages:
            raise ApiError(400, "input: must not be empty", param="input")
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "stop": self.stop,
            "user": self.user,
            "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,  # the last event's usage
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        tools = self.function_tools()
        if tools:
            fields["tools"] = [
                {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                for tool in tools
            ]
        if self.tool_choice is not None:
            choice = self.tool_choice
            fields["tool_choice"] = (
                choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
            )
        if self.wants_logprobs:
            fields.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        text_format = self.text.format if self.text else None
        if text_format is not None and text_format.type != "text":
            fields["response_format"] = _response_format(text_format)
        body = json.dumps({k: v for k, v in fields.items() if v is not None}).encode()
        return parse_body(ChatCompletionRequest, body)

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":  # the calls of one turn: one message
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        return messages


def _text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.schema_ is None:
        raise ApiError(400, "text.format.schema: required for json_schema", param="text")
    spec = {"name": text_format.name, "schema": text_format.schema_, "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


@contextmanager
def renamed_params() -> Iterator[None]:
    """Errors raised answering a Responses request as a chat request name this API's fields."""
    try:
        yield
    except ApiError as error:
        param = error.body["error"]["param"]
        if param in _PARAMS:
            error.body["error"]["param"] = _PARAMS[param]
        raise
    except InvalidRequestError as error:
        if error.param in _PARAMS:
            raise InvalidRequestError(_PARAMS[error.param], error.message, error.code) from None
        raise
