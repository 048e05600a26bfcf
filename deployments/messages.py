"""What the Ingress and an EngineReplica send each other through a DeploymentHandle.

Plain dataclasses with no torch import, so the Ingress process stays light."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4  # chat template markup around each message
DEFAULT_EXPECTED_OUTPUT = 256  # when neither the request nor the server caps max_tokens

# Text, or token ids (completions); or a conversation of {"role", "content"} messages (chat).
Prompt = str | list[int]
Conversation = list[dict[str, str]]


@dataclass
class GenerateRequest:
    """One HTTP request: completion prompts or chat conversations, each answered `n` times."""

    request_id: str
    prompts: list[Prompt] = field(default_factory=list)
    conversations: list[Conversation] = field(default_factory=list)
    n: int = 1
    # SamplingParams fields. max_tokens None: default_max_tokens, or the rest of the context
    # (OpenAI's default), whichever is smaller.
    sampling: dict[str, Any] = field(default_factory=dict)
    default_max_tokens: int | None = None

    def estimated_tokens(self) -> int:
        """Prompt + output tokens this request may hold in KV cache, all choices together; known
        before tokenization (about 4 characters a token), for the router's pressure estimate."""
        prompt_tokens = [
            len(p) if isinstance(p, list) else len(p) // CHARS_PER_TOKEN + 1 for p in self.prompts
        ]
        prompt_tokens += [
            sum(len(m["content"]) // CHARS_PER_TOKEN + TOKENS_PER_MESSAGE for m in c)
            for c in self.conversations
        ]
        max_tokens = self.sampling.get("max_tokens") or self.default_max_tokens or DEFAULT_EXPECTED_OUTPUT
        return self.n * sum(tokens + max_tokens for tokens in prompt_tokens)


@dataclass
class ChoiceDelta:
    """New tokens of one choice since its last delta."""

    index: int
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # of the prompt, found in the replica's prefix cache


@dataclass
class GenerateError:
    """Why a request ends without its answer: sent instead of any delta when the engine refuses
    it (400), or in place of the rest when the engine fails while serving it (500, 503)."""

    message: str
    param: str | None
    code: str | None
    status: int = 400
