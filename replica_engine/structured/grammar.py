"""Grammars for constrained requests (xgrammar, the backend vLLM and SGLang default to).

A GrammarCompiler turns a request's StructuredOutputs into a compiled grammar, off the step
thread (AsyncEngine compiles on a worker thread before the request enters the queue) and cached
by spec (xgrammar's own cache). Each constrained request owns a RequestGrammar: its matcher's
state, which only the step thread advances (a sampled token is accepted in the scheduler's
update) and which survives preemption (the tokens it has accepted are kept, never resampled)."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

import torch
import xgrammar as xgr
from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase
from xgrammar.structural_tag import (
    GrammarFormat,
    JSONSchemaFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

from common.errors import InvalidRequestError
from common.reasoning_parsers import END, PARSERS, START
from common.structured_outputs import StructuredOutputs, ToolCallGrammar
from replica_engine.structured.schema_check import check_schema

# The tokenizer of this process's compiler: a RequestGrammar sent to another process (the engine
# core's) is rebuilt there against it (xgrammar's compiled grammars serialize without it).
_tokenizer_info: xgr.TokenizerInfo | None = None
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[05:41:18] /project/cpp/x.cc:83: " before xgrammar's text


@dataclass(frozen=True)
class ThinkingGate:
    """Where a reasoning model's free thinking ends and its grammar begins: at the `end` token.
    `may_open`: the answer thinks only where its first token is `start` (Qwen3's); else it
    starts inside the thinking (DeepSeek-R1's template opens it in the prompt)."""

    start: int
    end: int
    may_open: bool


class GrammarCompiler:
    def __init__(
        self,
        info: xgr.TokenizerInfo,
        any_whitespace: bool = False,
        think_tokens: tuple[int, int] | None = None,
    ) -> None:
        global _tokenizer_info
        _tokenizer_info = info
        self.vocab_size = info.vocab_size
        self.any_whitespace = any_whitespace  # the server's default; a request may override it
        # <think> and </think>, where each is one token: a reasoning model's grammar waits for them
        self.think_tokens = think_tokens
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._lock = threading.Lock()  # one compile at a time: a replica's CPU is the step's too

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: frozenset[int],
        any_whitespace: bool = False,
    ) -> GrammarCompiler:
        """For the model's tokenizer; any of `stop_token_ids` (eos, chat-end) ends a grammar."""
        stop = sorted(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        tags = [tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END)]
        think_tokens = (tags[0][0], tags[1][0]) if all(len(ids) == 1 for ids in tags) else None
        return cls(info, any_whitespace, think_tokens)

    def compile(self, spec: StructuredOutputs) -> RequestGrammar:
        """A fresh matcher for `spec`, or InvalidRequestError naming the request field it came from."""
        if spec.json is not None:
            check_schema(json.loads(spec.json), spec.param)
        if spec.tool_calls is not None:
            for tool in json.loads(spec.tool_calls.tools):
                check_schema(tool["parameters"], spec.param)
        try:
            with self._lock:
                compiled = self._compile(spec)
        except InvalidRequestError:
            raise
        except Exception as error:  # xgrammar's RuntimeError (or its own types) for a bad spec
            lines = str(error).strip().splitlines() or [type(error).__name__]
            raise InvalidRequestError(spec.param, f"cannot compile: {_LOCATION.sub('', lines[-1])}") from None
        gate = None
        if spec.after_reasoning is not None and self.think_tokens is not None:
            gate = ThinkingGate(*self.think_tokens, may_open=not PARSERS[spec.after_reasoning])
        return RequestGrammar(compiled, self.vocab_size, gate)

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        # Compact JSON by default: with the layout free (vLLM's default), SmolLM2 ran to the length
        # limit on more requests (bench.quality.structured_quality); either loops on some prompts.
        any_whitespace = (
            self.any_whitespace if spec.disable_any_whitespace is None else not spec.disable_any_whitespace
        )
        if spec.json is not None:
            schema = spec.json
            return self._compiler.compile_json_schema(
                schema, any_whitespace=any_whitespace, strict_mode=spec.strict
            )
        if spec.json_object:  # an object, as OpenAI's json_object means (the builtin grammar takes any value)
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if spec.tool_calls is not None:
            return self._compiler.compile_structural_tag(_tool_call_tag(spec.tool_calls, any_whitespace))
        if spec.regex is not None:
            return self._compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return self._compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(choice) for choice in spec.choice)
            )
        assert spec.grammar is not None
        return self._compiler.compile_grammar(spec.grammar)


# The call formats, as xgrammar's builtin tags write them: hermes is Qwen's
# `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`; llama3_json is Llama 3.1's
# `{"name": ..., "parameters": ...}`. Then what goes between calls when they are required: hermes
# calls side by side, as vLLM's grammar has them (with a newline allowed there, SmolLM2 wrote one
# after its call and then the same call again, until max_tokens).
_XGRAMMAR_TOOL_FORMATS = {"hermes": "qwen_3", "llama3_json": "llama"}
_CALL_SEPARATORS = {"hermes": "", "llama3_json": "; "}


def _tool_call_tag(spec: ToolCallGrammar, any_whitespace: bool) -> xgr.StructuralTag:
    """The structural tag of a request's tool calls: outside a call the text is free (`auto`),
    inside one the name is a listed tool's and its arguments follow that tool's schema, laid out
    as our structured outputs are (`any_whitespace`)."""
    tools = [
        {"type": "function", "function": {"name": tool["name"], "parameters": tool["parameters"]}}
        for tool in json.loads(spec.tools)
    ]
    choice: str | dict[str, object] = spec.mode
    if spec.mode == "named":
        choice = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
    tag = xgr.get_builtin_structural_tag(
        _XGRAMMAR_TOOL_FORMATS[spec.format],
        tools=tools,
        tool_choice=choice,
        reasoning="disabled",
        parallel_tool_calls=spec.parallel,
    )
    _lay_out_json(tag.format, any_whitespace)
    if spec.mode != "required":
        return tag
    # Required: calls and nothing else (xgrammar's builtin lets text follow the first call, and
    # a small model then talks on to max_tokens).
    calls = tag.format
    assert isinstance(calls, TriggeredTagsFormat)
    only_calls = TagsWithSeparatorFormat(
        tags=calls.tags,
        separator=_CALL_SEPARATORS[spec.format],
        at_least_one=True,
        stop_after_first=calls.stop_after_first,
    )
    return xgr.StructuralTag(format=only_calls)


def _lay_out_json(node: BaseModel, any_whitespace: bool) -> None:
    """Every JSON schema under `node` as a grammar of our layout: xgrammar's structural tags leave
    JSON's whitespace free, and SmolLM2 then pretty-printed a call's arguments past max_tokens."""
    for name in type(node).model_fields:
        value = getattr(node, name)
        if isinstance(value, list):
            value[:] = [_laid_out(child, any_whitespace) for child in value]
        else:
            setattr(node, name, _laid_out(value, any_whitespace))


def _laid_out(value: object, any_whitespace: bool) -> object:
    if isinstance(value, JSONSchemaFormat) and value.style == "json":
        schema = json.dumps(value.json_schema)
        return GrammarFormat(grammar=str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)))
    if isinstance(value, BaseModel):
        _lay_out_json(value, any_whitespace)
    return value


class RequestGrammar:
    """One request's place in its grammar; with a ThinkingGate, first in its free thinking."""

    def __init__(
        self, compiled: xgr.CompiledGrammar, vocab_size: int, gate: ThinkingGate | None = None
    ) -> None:
        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._gate = gate
        self._num_accepted = 0
        # the first token may open the thinking; inside it, any token until its end
        self._may_open = gate is not None and gate.may_open
        self._thinking = gate is not None and not gate.may_open

    def __reduce__(self) -> tuple[object, tuple[str, int, ThinkingGate | None]]:
        """Pickles as its compiled grammar, before any token (a request on its way to the core)."""
        if self._num_accepted:
            raise ValueError("a grammar that has accepted tokens cannot be sent")
        return _rebuild, (self._compiled.serialize_json(), self.vocab_size, self._gate)

    def fill_allowed_tokens(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of `bitmask` (new_bitmask's): the tokens the grammar allows next. Reads the
        matcher only, so it may run on another thread while nothing advances it."""
        if self._thinking:
            bitmask[index] = -1  # every bit set
            return
        self._matcher.fill_next_token_bitmask(bitmask, index)
        if self._may_open:
            assert self._gate is not None
            word, bit = divmod(self._gate.start, 32)
            value = (int(bitmask[index, word]) & 0xFFFFFFFF) | (1 << bit)
            bitmask[index, word] = value - (1 << 32) if value >= 1 << 31 else value  # as int32

    def accept(self, token_id: int) -> bool:
        self._num_accepted += 1
        if self._may_open:
            assert self._gate is not None
            self._may_open = False
            if token_id == self._gate.start:
                self._thinking = True
                return True
        if self._thinking:
            assert self._gate is not None
            self._thinking = token_id != self._gate.end
            return True
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted."""
        return self._matcher.is_terminated()


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """Bitmasks of int32 words ([num_rows, ceil(vocab/32)]) for fill_allowed_tokens."""
    return xgr.allocate_token_bitmask(num_rows, vocab_size)


def _rebuild(compiled_json: str, vocab_size: int, gate: ThinkingGate | None) -> RequestGrammar:
    if _tokenizer_info is None:
        raise RuntimeError("this process has no GrammarCompiler to rebuild a grammar against")
    compiled = xgr.CompiledGrammar.deserialize_json(compiled_json, _tokenizer_info)
    return RequestGrammar(compiled, vocab_size, gate)


# byte value -> its 8 bits, least significant first (token w*32 + i is bit i of word w)
_BITS_OF_BYTE = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


def apply_token_bitmasks(logits: torch.Tensor, rows: list[int], bitmasks: list[torch.Tensor]) -> None:
    """Set to -inf, in place, every logit of row rows[i] that bitmasks[i] does not allow. Unpacked
    through a byte table: ~50 us a row for any mask, where xgrammar's CPU kernel takes up to
    ~110 us a row (2 ns per masked token) and ~100x that given row indices."""
    index = torch.tensor(rows, device=logits.device)
    words = torch.cat(bitmasks).to(logits.device)
    table = _BITS_OF_BYTE.to(logits.device)
    allowed = table[words.view(torch.uint8).int()].view(len(rows), -1)[:, : logits.shape[-1]]
    logits[index] = torch.where(allowed, logits[index], float("-inf"))
