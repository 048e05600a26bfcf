"""What the Ingress and an EngineReplica send each other through a DeploymentHandle.

Plain dataclasses with no torch import, so the Ingress process stays light."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class ChoiceDelta:
    """New tokens of one choice since its last delta."""

    index: int
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: str | None = None


@dataclass
class GenerateError:
    """A request the engine refused (the Ingress answers 400); sent instead of any delta."""

    message: str
    param: str | None
    code: str | None
