"""A chat request's tools (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) and the tool
calls in its history: the body's types, their checks (a 400 naming the field), and what they
become: the chat template's `tools` and messages, and the grammar that holds calls to the tools'
schemas (ToolCallGrammar: `auto` lets the model choose text, `required` and a named function make
it call)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from common.errors import InvalidRequestError
from common.structured_outputs import ToolCallGrammar

MAX_TOOLS = 128


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's rule (and "." for namespaces)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: the function takes no arguments
    strict: bool | None = None  # calls always follow the schema: the grammar holds them to it


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition

    def template_input(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI writes it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


def tool_calls_input(calls: list[ToolCall], index: int) -> list[dict[str, Any]]:
    """An assistant message's calls for the chat template, arguments as objects (what templates
    write out with tojson)."""
    rendered = []
    for k, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            field = f"message {index}: tool_calls.{k}.function.arguments"
            raise InvalidRequestError("messages", f"{field} is not valid JSON") from None
        function = {"name": call.function.name, "arguments": arguments}
        rendered.append({"id": call.id, "type": "function", "function": function})
    return rendered


def check_tool_results(messages: list[dict[str, Any]]) -> None:
    """Every tool message answers a call made earlier in the conversation."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        called.update(call["id"] for call in message.get("tool_calls") or ())
        if message["role"] == "tool" and message.get("tool_call_id") not in called:
            raise InvalidRequestError(
                "messages",
                f"message {i}: tool_call_id {message.get('tool_call_id')!r} answers no call of an "
                "earlier assistant message",
            )


def tool_mode(tools: list[Tool] | None, choice: ToolChoice | None) -> tuple[str, list[Tool]]:
    """(none | auto | required | named, the tools calls may use), the request's choice checked."""
    tools = tools or []
    names = [tool.function.name for tool in tools]
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools")
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools", "function names must be unique")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return "none", []
    if not tools:
        raise InvalidRequestError("tool_choice", "needs tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequestError("tool_choice", f"no tool named {choice.function.name!r}")
        return "named", [tools[names.index(choice.function.name)]]
    return choice, tools


# A tool that leaves out `parameters` (or gives `{}`) takes none: "omitting parameters defines a
# function with an empty parameter list" (OpenAI's API reference; vLLM's grammar has `{}` too).
# Under the grammar's strict JSON schemas, no properties means no key at all: its arguments are `{}`.
NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_grammar(mode: str, tools: list[Tool], call_format: str, parallel: bool) -> ToolCallGrammar:
    schemas = [
        {"name": tool.function.name, "parameters": tool.function.parameters or NO_PARAMETERS}
        for tool in tools
    ]
    return ToolCallGrammar(call_format, json.dumps(schemas), mode, parallel)
