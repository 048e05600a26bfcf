"""What a request constrains its output to (vLLM's `structured_outputs`; OpenAI's `response_format`
maps onto it): exactly one of a JSON schema, any JSON object, a regex, a choice of strings, an
EBNF grammar, or tool calls (a chat request's `tools`). Torch-free: the Ingress builds it; the
replica compiles it (replica_engine.structured)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from common.errors import InvalidRequestError

# Larger specs are refused before anything compiles them: a grammar compiles on a replica's CPU.
MAX_SPEC_BYTES = 64 << 10
MAX_CHOICES = 256
TOOL_CALL_FORMATS = ("hermes", "llama3_json")  # how a model writes a call (the tool_call_parser names)
TOOL_CHOICE_MODES = ("auto", "required", "named")


@dataclass(frozen=True)
class ToolCallGrammar:
    """Calls to a request's tools, in the model's own call format. `auto`: free text, and any
    call the model starts is a valid one; `required`: one call or more (one unless `parallel`);
    `named`: one call to the only tool listed."""

    format: str  # one of TOOL_CALL_FORMATS
    tools: str  # JSON: [{"name", "parameters"}], each parameters a JSON schema
    mode: str  # one of TOOL_CHOICE_MODES
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.format not in TOOL_CALL_FORMATS or self.mode not in TOOL_CHOICE_MODES:
            raise InvalidRequestError(
                "tool_choice", f"no calls in format {self.format!r}, mode {self.mode!r}"
            )


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None  # a JSON schema, as JSON text (its own key order kept)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF (GBNF / xgrammar's dialect)
    tool_calls: ToolCallGrammar | None = None
    # strict (OpenAI's json_schema.strict): no properties or items beyond the schema's own
    strict: bool = False
    # JSON without free whitespace (vLLM's per-request field); None: the server's setting
    disable_any_whitespace: bool | None = None
    # a reasoning parser's name (common.reasoning_parsers): the grammar holds after the model's
    # thinking, which is free (as vLLM's structured outputs with a reasoning parser)
    after_reasoning: str | None = None
    param: str = field(default="structured_outputs", compare=False)  # the request field it came from

    def __post_init__(self) -> None:
        kinds = [
            name
            for name in ("json", "regex", "choice", "grammar", "tool_calls")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(kinds) != 1:
            raise InvalidRequestError(
                self.param,
                "give exactly one of json, json_object, regex, choice, grammar"
                + (f" (got {', '.join(kinds)})" if kinds else ""),
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise InvalidRequestError(self.param, f"{name} must be a non-empty string")
            if len(value.encode()) > MAX_SPEC_BYTES:
                raise InvalidRequestError(self.param, f"{name} exceeds {MAX_SPEC_BYTES} bytes")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                raise InvalidRequestError(self.param, f"json is not valid JSON: {error}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError(self.param, "json must be a JSON schema (an object)")
        if self.choice is not None:
            choices = self.choice
            if not isinstance(choices, tuple) or not choices or len(choices) > MAX_CHOICES:
                raise InvalidRequestError(self.param, f"choice must list 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in choices):
                raise InvalidRequestError(self.param, "choice must list non-empty strings")
            if sum(len(c.encode()) for c in choices) > MAX_SPEC_BYTES:
                raise InvalidRequestError(self.param, f"choice exceeds {MAX_SPEC_BYTES} bytes")

    @classmethod
    def from_schema(cls, schema: Any, strict: bool, param: str) -> StructuredOutputs:
        """A JSON schema given as an object (as OpenAI's response_format carries it)."""
        return cls(json=json.dumps(schema), strict=strict, param=param)
