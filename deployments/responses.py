"""OpenAI response bodies, whole and streamed, built from the replicas' ChoiceDeltas."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from common.messages import ChoiceDelta


@dataclass(frozen=True)
class Endpoint:
    """How one OpenAI endpoint spells its objects and choices."""

    id_prefix: str
    object_name: str
    chunk_object_name: str
    is_chat: bool

    def choice(
        self, index: int, text: str, finish_reason: FinishReason | None, token_ids: list[int] | None
    ) -> dict[str, object]:
        body: dict[str, object] = {"index": index}
        if self.is_chat:
            body["message"] = {"role": "assistant", "content": text}
        else:
            body["text"] = text
        return {**body, **_finish_reason(finish_reason), "logprobs": None, **_token_ids(token_ids)}

    def sends(self, delta: ChoiceDelta, first: bool) -> bool:
        """Whether a delta gets a chunk. Completions send one per delta with tokens, even when
        its text is empty (a partial UTF-8 character, a model without a tokenizer), as vLLM
        does; chat sends text only, after the first chunk that names the role."""
        if delta.text or delta.finish_reason or (first and self.is_chat):
            return True
        return bool(delta.token_ids) and not self.is_chat

    def chunk_choice(self, delta: ChoiceDelta, first: bool, with_token_ids: bool) -> dict[str, object]:
        body: dict[str, object] = {"index": delta.index}
        if self.is_chat:
            body["delta"] = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        else:
            body["text"] = delta.text
        token_ids = _token_ids(delta.token_ids if with_token_ids else None)
        return {**body, **_finish_reason(delta.finish_reason), "logprobs": None, **token_ids}


def _finish_reason(reason: FinishReason | None) -> dict[str, object]:
    """OpenAI's finish_reason: the enum's string, null while the choice goes on."""
    return {"finish_reason": None if reason is None else reason.value}


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
    created: int = field(default_factory=lambda: int(time.time()))

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
        async for batch in batches:
            for delta in batch:
                self.usage.add(delta)
                texts[delta.index] = texts.get(delta.index, "") + delta.text
                token_ids[delta.index] = token_ids.get(delta.index, []) + delta.token_ids
                finish_reasons[delta.index] = delta.finish_reason
        choices = [
            self.endpoint.choice(
                i, texts[i], finish_reasons[i], token_ids[i] if self.return_token_ids else None
            )
            for i in sorted(texts)
        ]
        return {
            **self._envelope(self.endpoint.object_name),
            "choices": choices,
            "usage": self.usage.as_dict(),
        }

    async def events(self, batches: AsyncIterator[list[ChoiceDelta]]) -> AsyncIterator[str]:
        started: set[int] = set()
        async for batch in batches:
            choices = []
            for delta in batch:
                self.usage.add(delta)
                first = delta.index not in started
                if self.endpoint.sends(delta, first):
                    choices.append(self.endpoint.chunk_choice(delta, first, self.return_token_ids))
                    started.add(delta.index)
            if choices:
                yield self._event(choices)
        if self.include_usage:
            yield sse_event(
                {
                    **self._envelope(self.endpoint.chunk_object_name),
                    "choices": [],
                    "usage": self.usage.as_dict(),
                }
            )
        yield "data: [DONE]\n\n"

    def _event(self, choices: Iterable[dict[str, object]]) -> str:
        chunk = {**self._envelope(self.endpoint.chunk_object_name), "choices": list(choices)}
        if self.include_usage:  # OpenAI: with include_usage, every other chunk says usage: null
            chunk["usage"] = None
        return sse_event(chunk)


def sse_event(body: dict[str, object]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
