"""Logprobs in OpenAI's shapes: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`
and completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (with echo, the prompt's
tokens first, the first of them without a logprob)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.logprobs import TokenLogprob

# JSON has no -inf: a token the grammar ruled out gets vLLM's stand-in.
MIN_LOGPROB = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


@dataclass(frozen=True)
class EchoedPrompt:
    """A completion prompt sent back before its choices (`echo`)."""

    text: str
    token_ids: list[int]


@dataclass
class LogprobsFormat:
    token_text: Callable[[int], str]  # a token's own text
    is_chat: bool
    offsets: dict[int, int] = field(default_factory=dict)  # completions: next text offset per choice

    def render(
        self,
        index: int,
        logprobs: list[TokenLogprob],
        echoed: EchoedPrompt | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, object]:
        """One choice's logprobs (or one chunk's share of them); `echoed` puts its prompt's
        tokens first, with `prompt_logprobs` (of prompt tokens 1..) where the request asked."""
        if self.is_chat:
            return {"content": [self._chat_entry(logprob) for logprob in logprobs]}
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = self.offsets.get(index, 0)
        entries: list[tuple[int, TokenLogprob | None]] = []
        if echoed is not None:
            by_position = [None, *(prompt_logprobs or [])]
            entries += [
                (t, by_position[i] if i < len(by_position) else None) for i, t in enumerate(echoed.token_ids)
            ]
        entries += [(logprob.token_id, logprob) for logprob in logprobs]
        for token_id, logprob in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            token_logprobs.append(None if logprob is None else _value(logprob.logprob))
            top.append(None if logprob is None else self._top_dict(logprob))
        self.offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _chat_entry(self, logprob: TokenLogprob) -> dict[str, object]:
        return {
            **self._token(logprob.token_id, logprob.logprob),
            "top_logprobs": [self._token(token_id, value) for token_id, value in logprob.top],
        }

    def _token(self, token_id: int, logprob: float) -> dict[str, object]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", "replace"))}

    def _top_dict(self, logprob: TokenLogprob) -> dict[str, float]:
        """Completions: the likeliest tokens and the chosen one (as OpenAI and vLLM)."""
        top = {self.token_text(token_id): _value(value) for token_id, value in logprob.top}
        top.setdefault(self.token_text(logprob.token_id), _value(logprob.logprob))
        return top

    def vllm_prompt_logprobs(self, logprobs: list[TokenLogprob]) -> list[dict[str, object] | None]:
        """vLLM's `prompt_logprobs`: per prompt token (the first has none), the token itself and
        the likeliest ones, by token id: {logprob, rank, decoded_token}."""
        rendered: list[dict[str, object] | None] = [None]
        for logprob in logprobs:
            entry = {
                str(token_id): {
                    "logprob": _value(value),
                    "rank": rank,
                    "decoded_token": self.token_text(token_id),
                }
                for rank, (token_id, value) in enumerate(logprob.top, start=1)
            }
            entry[str(logprob.token_id)] = {
                "logprob": _value(logprob.logprob),
                "rank": logprob.rank,
                "decoded_token": self.token_text(logprob.token_id),
            }
            rendered.append(entry)
        return rendered
