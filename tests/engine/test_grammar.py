"""The grammar layer on its own (no model): every JSON-schema keyword we accept is enforced (a
valid instance accepted, an invalid one refused, by a character-level vocabulary), and every one
we refuse is named."""

from __future__ import annotations

import json
import pickle

import pytest
import xgrammar as xgr

from common.errors import InvalidRequestError
from common.structured_outputs import StructuredOutputs, ToolCallGrammar
from replica_engine.structured.grammar import GrammarCompiler, RequestGrammar, new_bitmask
from replica_engine.structured.schema_check import check_schema

VOCAB = [chr(code) for code in range(32, 127)] + ["</s>"]
STOP = len(VOCAB) - 1


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[STOP]))


def accepts(compiler: GrammarCompiler, spec: StructuredOutputs, text: str) -> bool:
    grammar = compiler.compile(spec)
    return all(grammar.accept(VOCAB.index(char)) for char in text) and grammar.accept(STOP)


OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
# keyword: (schema, a valid instance, an invalid one), JSON as we generate it (", " and ": ")
ENFORCED = {
    "type": ({"type": "integer"}, "3", '"3"'),
    "enum": ({"enum": ["x", 1]}, "1", "2"),
    "const": ({"const": "x"}, '"x"', '"y"'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, '"s"', "true"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"s"'),
    "allOf": ({"allOf": [{"type": "integer"}]}, "4", '"s"'),
    "$ref": ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}, "1", '"s"'),
    "properties": (OBJECT, '{"a": 1}', '{"a": "x"}'),
    "required": ({**OBJECT, "required": ["a"]}, '{"a": 1}', '{"b": "x"}'),
    "additionalProperties": ({**OBJECT, "additionalProperties": False}, '{"a": 1}', '{"c": 1}'),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^x"}}, '{"x": 1}', '{"y": 1}'),
    "minProperties": ({"type": "object", "minProperties": 1}, '{"a": 1}', "{}"),
    "maxProperties": ({"type": "object", "maxProperties": 1}, '{"a": 1}', '{"a": 1, "b": 2}'),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1, 2]", '[1, "x"]'),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1]", "[1, 2]"),
    "unevaluatedItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
        "[1]",
        "[1, 2]",
    ),
    "minItems": ({"type": "array", "minItems": 2}, "[1, 2]", "[1]"),
    "maxItems": ({"type": "array", "maxItems": 1}, "[1]", "[1, 2]"),
    "minLength": ({"type": "string", "minLength": 2}, '"ab"', '"a"'),
    "maxLength": ({"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    "pattern": ({"type": "string", "pattern": "^[a-z]+$"}, '"ab"', '"A1"'),
    "format": ({"type": "string", "format": "date"}, '"2025-01-31"', '"soon"'),
    "minimum": ({"type": "integer", "minimum": 3}, "3", "2"),
    "maximum": ({"type": "integer", "maximum": 3}, "3", "4"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 3}, "2", "3"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "6", "4"),
}


@pytest.mark.parametrize("keyword", list(ENFORCED))
def test_every_accepted_keyword_is_enforced(compiler: GrammarCompiler, keyword: str):
    schema, valid, invalid = ENFORCED[keyword]
    spec = StructuredOutputs(json=json.dumps(schema))
    assert accepts(compiler, spec, valid), f"{keyword}: valid {valid} refused"
    assert not accepts(compiler, spec, invalid), f"{keyword}: invalid {invalid} accepted"


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"not": {"type": "string"}}, "'not'"),
        ({"type": "object", "if": {}, "then": {}}, "'if'"),
        ({"type": "array", "contains": {"type": "integer"}}, "'contains'"),
        ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
        ({"type": "object", "unevaluatedProperties": False}, "'unevaluatedProperties'"),
        ({"type": "object", "patternProperties": {"^x": {}}}, "'patternProperties'"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf with more than one"),
        ({"$ref": "https://example.com/schema.json"}, "only local references"),
        ({"type": "string", "format": "idn-email"}, "format 'idn-email'"),
        ({"type": "object", "properties": {"a": {"not": {}}}}, "#/properties/a/not"),
    ],
)
def test_a_keyword_that_would_not_be_enforced_is_named(schema: dict, named: str):
    with pytest.raises(InvalidRequestError, match=named) as raised:
        check_schema(schema, "response_format")
    assert raised.value.param == "response_format"


def test_the_choice_of_strings_and_the_json_object(compiler: GrammarCompiler):
    choice = StructuredOutputs(choice=("yes", 'say "no"'))
    assert accepts(compiler, choice, 'say "no"') and not accepts(compiler, choice, "maybe")
    json_object = StructuredOutputs(json_object=True)
    assert accepts(compiler, json_object, '{"a": [1, {}]}') and not accepts(compiler, json_object, "[1]")


def test_strict_allows_no_unnamed_property(compiler: GrammarCompiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts(compiler, StructuredOutputs(json=json.dumps(schema)), '{"a": 1, "z": 2}')
    assert not accepts(compiler, StructuredOutputs(json=json.dumps(schema), strict=True), '{"a": 1, "z": 2}')


@pytest.mark.parametrize(
    "spec",
    [
        {"regex": "[a-"},
        {"grammar": "root ::= "},
        {
            "json": json.dumps(
                {"type": "object", "minProperties": 3, "properties": {}, "additionalProperties": False}
            )
        },
    ],
)
def test_a_spec_that_does_not_compile_is_refused_naming_its_field(compiler: GrammarCompiler, spec: dict):
    with pytest.raises(InvalidRequestError, match="cannot compile") as raised:
        compiler.compile(StructuredOutputs(**spec, param="structured_outputs"))
    assert raised.value.param == "structured_outputs" and "/project/" not in str(raised.value)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"regex": "a", "choice": ("a",)},
        {"json": "{"},
        {"json": "[1]"},
        {"choice": ()},
        {"regex": "x" * 70000},
    ],
)
def test_a_malformed_spec_is_refused_before_compiling(fields: dict):
    with pytest.raises(InvalidRequestError) as raised:
        StructuredOutputs(**fields, param="response_format")
    assert raised.value.param == "response_format"


def test_json_is_compact_by_default_and_free_whitespace_is_a_setting():
    spaced = '{  "a" : 1 ,   "b": "x" }'  # the vocabulary has no newline: spaces only
    info = xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[STOP])
    free, compact = GrammarCompiler(info, any_whitespace=True), GrammarCompiler(info)
    schema = json.dumps(OBJECT)
    assert accepts(free, StructuredOutputs(json=schema), spaced)
    assert accepts(free, StructuredOutputs(json_object=True), spaced)
    assert not accepts(compact, StructuredOutputs(json=schema), spaced)
    assert accepts(compact, StructuredOutputs(json=schema), '{"a": 1, "b": "x"}')
    # a request's own choice wins over the server's, either way
    assert not accepts(free, StructuredOutputs(json=schema, disable_any_whitespace=True), spaced)
    assert accepts(compact, StructuredOutputs(json=schema, disable_any_whitespace=False), spaced)


TOOL_VOCAB = [*VOCAB[:-1], "\n", "</s>"]  # the call formats put calls on lines of their own


@pytest.fixture(scope="module")
def tool_compiler() -> GrammarCompiler:
    stop = len(TOOL_VOCAB) - 1
    return GrammarCompiler(xgr.TokenizerInfo(TOOL_VOCAB, vocab_size=len(TOOL_VOCAB), stop_token_ids=[stop]))


def tool_text_accepted(compiler: GrammarCompiler, spec: StructuredOutputs, text: str) -> bool:
    grammar = compiler.compile(spec)
    return all(grammar.accept(TOOL_VOCAB.index(c)) for c in text) and grammar.accept(len(TOOL_VOCAB) - 1)


TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {"party": {"type": "object", "properties": {"adults": {"type": "integer"}}}},
            "required": ["party"],
        },
    },
]
BOOK = '<tool_call>\n{"name": "book", "arguments": {"party": {"adults": 2}}}\n</tool_call>'
WRONG_TYPE = '<tool_call>\n{"name": "book", "arguments": {"party": {"adults": "two"}}}\n</tool_call>'
UNKNOWN = '<tool_call>\n{"name": "fly", "arguments": {}}\n</tool_call>'
LLAMA_BOOK = '{"name": "book", "parameters": {"party": {"adults": 2}}}'


@pytest.mark.parametrize(
    ("mode", "parallel", "text", "accepted"),
    [
        ("auto", True, "It is sunny.", True),
        ("auto", True, f"Booking.{BOOK}", True),
        ("auto", True, WRONG_TYPE, False),  # once a call starts, it follows its tool's schema
        ("auto", True, UNKNOWN, False),
        ("required", True, "It is sunny.", False),
        ("required", True, BOOK, True),
        ("required", True, f"{BOOK}{BOOK}", True),  # calls side by side, as vLLM's grammar writes them
        ("required", True, f"{BOOK}\n{BOOK}", False),  # no line between: SmolLM2 wrote one, then a call again
        ("required", False, f"{BOOK}{BOOK}", False),
        ("required", True, f"{BOOK} And more.", False),  # calls and nothing else
        ("required", True, WRONG_TYPE, False),
        ("named", True, BOOK, True),
        ("named", True, f"{BOOK}{BOOK}", False),
    ],
)
def test_tool_calls_follow_the_tools_schemas(
    tool_compiler: GrammarCompiler, mode: str, parallel: bool, text: str, accepted: bool
):
    tools = TOOLS[1:] if mode == "named" else TOOLS
    spec = StructuredOutputs(
        tool_calls=ToolCallGrammar("hermes", json.dumps(tools), mode, parallel), param="tools"
    )
    assert tool_text_accepted(tool_compiler, spec, text) == accepted
    llama = StructuredOutputs(tool_calls=ToolCallGrammar("llama3_json", json.dumps(TOOLS), "required"))
    assert tool_text_accepted(tool_compiler, llama, LLAMA_BOOK)


def test_a_tool_without_parameters_is_called_with_none(tool_compiler: GrammarCompiler):
    """A tool that leaves out `parameters` takes none (deployments.chat_tools.NO_PARAMETERS): its
    arguments are `{}`; SmolLM2 once made one up for a tool named `now`, the time in a string."""
    tools = json.dumps([{"name": "now", "parameters": {"type": "object", "properties": {}}}])
    spec = StructuredOutputs(tool_calls=ToolCallGrammar("hermes", tools, "required"), param="tools")

    def called(arguments: str) -> str:
        return f'<tool_call>\n{{"name": "now", "arguments": {arguments}}}\n</tool_call>'

    assert tool_text_accepted(tool_compiler, spec, called("{}"))
    assert not tool_text_accepted(tool_compiler, spec, called('{"time": "12:00"}'))


def test_a_tool_schema_that_does_not_compile_is_refused_naming_tools(compiler: GrammarCompiler):
    bad = [{"name": "f", "parameters": {"type": "object", "minProperties": 3, "additionalProperties": False}}]
    with pytest.raises(InvalidRequestError) as raised:
        compiler.compile(
            StructuredOutputs(
                tool_calls=ToolCallGrammar("hermes", json.dumps(bad), "required"), param="tools"
            )
        )
    assert raised.value.param == "tools"
    nonsense = [{"name": "f", "parameters": {"type": "frobnicate"}}]
    with pytest.raises(InvalidRequestError, match="tools"):
        compiler.compile(
            StructuredOutputs(
                tool_calls=ToolCallGrammar("hermes", json.dumps(nonsense), "auto"), param="tools"
            )
        )


THINKING_VOCAB = [*VOCAB[:-1], "<think>", "</think>", "</s>"]
OPEN, CLOSE, END_OF_TEXT = (THINKING_VOCAB.index(tag) for tag in ("<think>", "</think>", "</s>"))


def thinking_tokens(text: str) -> list[int]:
    """`text` as tokens of THINKING_VOCAB, its tags as one token each."""
    tokens: list[int] = []
    while text:
        tag = next((t for t in ("<think>", "</think>") if text.startswith(t)), text[0])
        tokens.append(THINKING_VOCAB.index(tag))
        text = text[len(tag) :]
    return tokens


def allowed(grammar: RequestGrammar, token: int) -> bool:
    bitmask = new_bitmask(1, len(THINKING_VOCAB))
    grammar.fill_allowed_tokens(bitmask, 0)
    word, bit = divmod(token, 32)
    return bool((int(bitmask[0, word]) >> bit) & 1)


def generated(grammar: RequestGrammar, text: str) -> bool:
    """Every token of `text` then the end of text allowed by the grammar's mask, and accepted."""
    for token in [*thinking_tokens(text), END_OF_TEXT]:
        if not (allowed(grammar, token) and grammar.accept(token)):
            return False
    return grammar.is_terminated


@pytest.mark.parametrize(
    ("parser", "text", "accepted"),
    [
        ("qwen3", '<think>Not JSON, { at all.</think>{"a": 1}', True),  # free thinking, then the grammar
        ("qwen3", '{"a": 1}', True),  # no thinking: the grammar from the first token
        ("qwen3", 'Not JSON.</think>{"a": 1}', False),  # thinking only where the answer opens it
        ("qwen3", '<think>Why.</think>{"a": "x"}', False),  # after it, the schema holds
        ("qwen3", '{"a": 1}<think>', False),  # only the first token may open it
        ("deepseek_r1", 'Not JSON, { at all.</think>{"a": 1}', True),  # its prompt opened it
        ("deepseek_r1", '{"a": 1}', False),  # still thinking at the end of text: no grammar done
        (None, '<think>Why.</think>{"a": 1}', False),  # without a parser, no thinking at all
    ],
)
def test_a_reasoning_models_grammar_holds_after_its_thinking(parser: str | None, text: str, accepted: bool):
    info = xgr.TokenizerInfo(THINKING_VOCAB, vocab_size=len(THINKING_VOCAB), stop_token_ids=[END_OF_TEXT])
    compiler = GrammarCompiler(info, think_tokens=(OPEN, CLOSE))
    grammar = compiler.compile(StructuredOutputs(json=json.dumps(OBJECT), after_reasoning=parser))
    assert generated(grammar, text) == accepted
    # a grammar on its way to the engine core's process keeps its gate
    sent = pickle.loads(
        pickle.dumps(compiler.compile(StructuredOutputs(json_object=True, after_reasoning=parser)))
    )
    assert generated(sent, '<think>x</think>{"a": 1}') == (parser is not None)
