"""OpenAI response bodies, whole and streamed, built from the replicas' ChoiceDeltas."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from common.logprobs import TokenLogprob
from common.messages import ChoiceDelta
from common.reasoning_parsers import StreamedReasoning, split_reasoning
from common.tool_parsers import StreamedMessage, parse_message
from deployments.logprobs_format import EchoedPrompt, LogprobsFormat


@dataclass(frozen=True)
class ToolCallReading:
    """How a chat answer's tool calls are read out of its text (the tool_call_parser), and how an
    answer that made calls finishes: `tool_calls` (tool_choice auto or required), or `stop` for a
    named tool_choice, as OpenAI's API and vLLM answer it."""

    format_name: str
    finish_reason: FinishReason = FinishReason.TOOL_CALLS


@dataclass(frozen=True)
class Reasoning:
    """A chat answer's reasoning (a reasoning parser's, sent: `include_reasoning`)."""

    text: str


@dataclass(frozen=True)
class Endpoint:
    """How one OpenAI endpoint spells its objects and choices."""

    id_prefix: str
    object_name: str
    chunk_object_name: str
    is_chat: bool

    def choice(
        self,
        index: int,
        text: str | None,
        finish_reason: FinishReason | None,
        token_ids: list[int] | None,
        logprobs: dict[str, object] | None,
        tool_calls: list[dict[str, object]] | None = None,
        reasoning: Reasoning | None = None,
    ) -> dict[str, object]:
        body: dict[str, object] = {"index": index}
        if self.is_chat:
            body["message"] = {
                "role": "assistant",
                **({"reasoning_content": reasoning.text or None} if reasoning is not None else {}),
                "content": text,
                **({"tool_calls": tool_calls} if tool_calls else {}),
            }
        else:
            body["text"] = text
        return {**body, **_finish_reason(finish_reason), "logprobs": logprobs, **_token_ids(token_ids)}

    def sends(self, delta: ChoiceDelta, first: bool) -> bool:
        """Whether a delta gets a chunk. Completions send one per delta with tokens, even when
        its text is empty (a partial UTF-8 character, a model without a tokenizer), as vLLM
        does; chat sends text only, after the first chunk that names the role."""
        if delta.text or delta.finish_reason or (first and self.is_chat):
            return True
        return bool(delta.token_ids) and not self.is_chat

    def chunk_choice(
        self,
        delta: ChoiceDelta,
        text: str,
        first: bool,
        with_token_ids: bool,
        logprobs: dict[str, object] | None,
        calls: tuple[list[dict[str, object]], FinishReason | None] | None = None,
        reasoning: str = "",
    ) -> dict[str, object]:
        """A chunk's choice; `calls`: the tool calls' deltas and the finish reason they make;
        `reasoning`: the new reasoning (a reasoning parser's, sent)."""
        body: dict[str, object] = {"index": delta.index}
        finish_reason = delta.finish_reason
        if self.is_chat:
            message: dict[str, object] = {"role": "assistant"} if first else {}
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls is not None and calls[0]:
                message.update(content=text or None, tool_calls=calls[0])
            else:
                message["content"] = text
            finish_reason = finish_reason if calls is None else calls[1]
            body["delta"] = message
        else:
            body["text"] = text
        token_ids = _token_ids(delta.token_ids if with_token_ids else None)
        return {**body, **_finish_reason(finish_reason), "logprobs": logprobs, **token_ids}


def _finish_reason(reason: FinishReason | None) -> dict[str, object]:
    """OpenAI's finish_reason: the enum's string, null while the choice goes on."""
    return {"finish_reason": None if reason is None else reason.value}


def _called(reading: ToolCallReading, reason: FinishReason | None, has_calls: bool) -> FinishReason | None:
    """An answer that stopped after calling tools finishes as `reading` says, whole or streamed."""
    return reading.finish_reason if has_calls and reason is FinishReason.STOP else reason


def _token_ids(token_ids: list[int] | None) -> dict[str, object]:
    return {} if token_ids is None else {"token_ids": token_ids}


COMPLETIONS = Endpoint("cmpl", "text_completion", "text_completion", is_chat=False)
CHAT = Endpoint("chatcmpl", "chat.completion", "chat.completion.chunk", is_chat=True)


@dataclass
class Usage:
    """Token counts of one HTTP request: each prompt counts once, however many choices it has."""

    n: int
    prompt_tokens_by_input: dict[int, int] = field(default_factory=dict)
    # Of each prompt, the tokens every one of its choices found cached (OpenAI's cached_tokens).
    cached_tokens_by_input: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, delta: ChoiceDelta) -> None:
        prompt_index = delta.index // self.n
        self.prompt_tokens_by_input[prompt_index] = delta.num_prompt_tokens
        cached = self.cached_tokens_by_input.get(prompt_index, delta.num_cached_tokens)
        self.cached_tokens_by_input[prompt_index] = min(cached, delta.num_cached_tokens)
        self.completion_tokens += len(delta.token_ids)

    def as_dict(self) -> dict[str, object]:
        prompt_tokens = sum(self.prompt_tokens_by_input.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens_by_input.values())},
        }


@dataclass
class ResponseWriter:
    """Turns one request's deltas into an OpenAI body (whole) or Server-Sent Events (streamed)."""

    endpoint: Endpoint
    request_id: str
    model: str
    usage: Usage
    include_usage: bool = False
    return_token_ids: bool = False
    logprobs: LogprobsFormat | None = None  # set when the request asked for logprobs
    prompt_logprobs: LogprobsFormat | None = None  # set when it asked for vLLM's prompt_logprobs
    echoed: list[EchoedPrompt] | None = None  # completions with echo: each prompt, sent back first
    echo_only: bool = False  # echo with max_tokens 0: the prompts alone (what is generated is not sent)
    # with return_token_ids: each prompt's ids, sent where vLLM sends them (a completion choice's,
    # once per chat answer), in a stream's first chunk of each
    prompt_token_ids: list[list[int]] | None = None
    tool_calls: ToolCallReading | None = None  # chat with tools: how calls are read out
    reasoning_parser: str | None = None  # chat: how reasoning is read out (common.reasoning_parsers)
    include_reasoning: bool = True  # the request's: send the reasoning read out, or drop it
    created: int = field(default_factory=lambda: int(time.time()))

    def _shown(self, delta: ChoiceDelta) -> ChoiceDelta:
        """The delta as the answer shows it: with echo_only, without what was generated (its
        prompt's fields and finish reason stay)."""
        return dataclasses.replace(delta, text="", token_ids=[], logprobs=[]) if self.echo_only else delta

    def _echoed(self, index: int) -> EchoedPrompt | None:
        return None if self.echoed is None else self.echoed[index // self.usage.n]

    def _logprobs(
        self,
        index: int,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob] | None,
        first: bool,
    ) -> dict[str, object] | None:
        if self.logprobs is None:
            return None
        echoed = self._echoed(index) if first else None
        return self.logprobs.render(index, logprobs, echoed, prompt_logprobs)

    def _answer(
        self, text: str, finish_reason: FinishReason | None
    ) -> tuple[str | None, FinishReason | None, list[dict[str, object]] | None, Reasoning | None]:
        """A whole choice's text, finish reason, tool calls (read out when the request has tools)
        and reasoning (read out first, with a reasoning parser)."""
        reasoning = None
        if self.reasoning_parser is not None:
            thought, text = split_reasoning(text, self.reasoning_parser, final=True)
            reasoning = Reasoning(thought) if self.include_reasoning else None
        if self.tool_calls is None:
            return text, finish_reason, None, reasoning
        message = parse_message(text, self.tool_calls.format_name)
        return (
            message.content,
            _called(self.tool_calls, finish_reason, bool(message.tool_calls)),
            message.tool_calls,
            reasoning,
        )

    def _streamed_calls(
        self, streams: dict[int, StreamedMessage], delta: ChoiceDelta, text: str
    ) -> tuple[str, tuple[list[dict[str, object]], FinishReason | None]]:
        """A streamed choice's new text and tool-call deltas (the request has tools)."""
        assert self.tool_calls is not None
        stream = streams.setdefault(delta.index, StreamedMessage(self.tool_calls.format_name))
        text, calls = stream.feed(text, final=delta.finish_reason is not None)
        return text, (calls, _called(self.tool_calls, delta.finish_reason, stream.has_calls))

    def _envelope(self, object_name: str) -> dict[str, object]:
        return {
            "id": f"{self.endpoint.id_prefix}-{self.request_id}",
            "object": object_name,
            "created": self.created,
            "model": self.model,
        }

    async def whole(self, batches: AsyncIterator[list[ChoiceDelta]]) -> dict[str, object]:
        texts: dict[int, str] = {}
        token_ids: dict[int, list[int]] = {}
        finish_reasons: dict[int, FinishReason | None] = {}
        logprobs: dict[int, list[TokenLogprob]] = {}
        prompt_logprobs: dict[int, list[TokenLogprob]] = {}
        async for batch in batches:
            for delta in map(self._shown, batch):
                self.usage.add(delta)
                echoed = self._echoed(delta.index) if delta.index not in texts else None
                texts[delta.index] = texts.get(delta.index, echoed.text if echoed else "") + delta.text
                token_ids[delta.index] = token_ids.get(delta.index, []) + delta.token_ids
                logprobs[delta.index] = logprobs.get(delta.index, []) + delta.logprobs
                if delta.prompt_logprobs is not None:
                    prompt_logprobs[delta.index] = delta.prompt_logprobs
                finish_reasons[delta.index] = delta.finish_reason
        choices = []
        for i in sorted(texts):
            text, finish_reason, calls, reasoning = self._answer(texts[i], finish_reasons[i])
            token_ids_i = token_ids[i] if self.return_token_ids else None
            logprobs_i = self._logprobs(i, logprobs[i], prompt_logprobs.get(i), first=True)
            choices.append(
                self.endpoint.choice(i, text, finish_reason, token_ids_i, logprobs_i, calls, reasoning)
            )
        body = {
            **self._envelope(self.endpoint.object_name),
            "choices": choices,
            "usage": self.usage.as_dict(),
        }
        if self.endpoint.is_chat:
            body |= self._prompt_ids(0)
        else:
            for choice in choices:
                choice |= self._prompt_ids(int(choice["index"]) // self.usage.n)  # type: ignore[call-overload]
        if self.prompt_logprobs is not None:  # where vLLM puts it: per choice; chat, once (one prompt)
            rendered = {
                i: self.prompt_logprobs.vllm_prompt_logprobs(found) for i, found in prompt_logprobs.items()
            }
            if self.endpoint.is_chat:
                body["prompt_logprobs"] = rendered.get(0)
            else:
                for choice in choices:
                    choice["prompt_logprobs"] = rendered.get(int(choice["index"]))  # type: ignore[call-overload]
        return body

    async def events(self, batches: AsyncIterator[list[ChoiceDelta]]) -> AsyncIterator[str]:
        """The chunks as Server-Sent Events, ending in [DONE]."""
        async for chunk in self.chunks(batches):
            yield sse_event(chunk)
        yield "data: [DONE]\n\n"

    async def chunks(self, batches: AsyncIterator[list[ChoiceDelta]]) -> AsyncIterator[dict[str, object]]:
        """A streamed answer's chunks; with include_usage, a last one with the usage alone."""
        started: set[int] = set()
        sent_any = False
        streams: dict[int, StreamedMessage] = {}
        thoughts: dict[int, StreamedReasoning] = {}
        async for batch in batches:
            choices = []
            for delta in map(self._shown, batch):
                self.usage.add(delta)
                first = delta.index not in started
                calls, text, reasoning = None, delta.text, ""
                if self.reasoning_parser is not None:
                    thought = thoughts.setdefault(delta.index, StreamedReasoning(self.reasoning_parser))
                    reasoning, text = thought.feed(text, final=delta.finish_reason is not None)
                    reasoning = reasoning if self.include_reasoning else ""
                if self.tool_calls is not None or self.reasoning_parser is not None:
                    if self.tool_calls is not None:
                        text, calls = self._streamed_calls(streams, delta, text)
                    # with logprobs, every token's chunk goes out, its text held back or not
                    with_logprobs = self.logprobs is not None and bool(delta.token_ids)
                    news = text or reasoning or (calls and calls[0])
                    sends = bool(news or delta.finish_reason or first or with_logprobs)
                else:
                    echoed = self._echoed(delta.index) if first else None
                    text = (echoed.text if echoed else "") + text
                    sends = self.endpoint.sends(delta, first)
                if sends:
                    logprobs = self._logprobs(delta.index, delta.logprobs, delta.prompt_logprobs, first)
                    choice = self.endpoint.chunk_choice(
                        delta, text, first, self.return_token_ids, logprobs, calls, reasoning
                    )
                    if first and not self.endpoint.is_chat:
                        choice |= self._prompt_ids(delta.index // self.usage.n)
                    choices.append(choice)
                    started.add(delta.index)
            if choices:
                chunk = self._chunk(choices)
                if not sent_any and self.endpoint.is_chat:
                    chunk |= self._prompt_ids(0)
                sent_any = True
                yield chunk
        if self.include_usage:
            yield {
                **self._envelope(self.endpoint.chunk_object_name),
                "choices": [],
                "usage": self.usage.as_dict(),
            }

    def _prompt_ids(self, prompt_index: int) -> dict[str, object]:
        """A prompt's ids, where the request asked for them (return_token_ids): vLLM puts them on
        each completion choice, and once beside a chat answer's choices."""
        return (
            {} if self.prompt_token_ids is None else {"prompt_token_ids": self.prompt_token_ids[prompt_index]}
        )

    def _chunk(self, choices: Iterable[dict[str, object]]) -> dict[str, object]:
        chunk = {**self._envelope(self.endpoint.chunk_object_name), "choices": list(choices)}
        if self.include_usage:  # OpenAI: with include_usage, every other chunk says usage: null
            chunk["usage"] = None
        return chunk


def sse_event(body: dict[str, object]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
