"""Prompts checked and tokenized: what the Ingress does before routing and the offline engine
does before queueing, in one place, so both refuse the same inputs with the same words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError
from common.model_source import ModelSource, context_length, model_config_dict
from common.tokenizer import Message, PromptTokenizer

Prompt = str | list[int]


@dataclass(frozen=True)
class PromptProcessor:
    tokenizer: PromptTokenizer | None  # None for dummy weights: token ids only
    vocab_size: int
    max_model_len: int  # prompt + output tokens of one request

    @classmethod
    def load(
        cls, source: ModelSource, max_model_len: int | None = None, chat_template: str | None = None
    ) -> PromptProcessor:
        """For a resolved model; `max_model_len` caps the model's own context; `chat_template`
        (a file or the template) replaces the model's own."""
        config = model_config_dict(source)
        model_max_len = context_length(config)
        if max_model_len is not None and max_model_len > model_max_len:
            raise InvalidRequestError(
                "max_model_len", f"{max_model_len} exceeds the model's context of {model_max_len} tokens"
            )
        tokenizer = PromptTokenizer.load(source.hf_dir, chat_template) if source.has_tokenizer else None
        return cls(tokenizer, config["vocab_size"], max_model_len or model_max_len)

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """Text through the tokenizer, or token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "prompt",
                    "this model has no tokenizer (dummy weights, or no tokenizer.json): pass token ids",
                )
            return self.tokenizer.encode(prompt, add_special_tokens)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError("prompt", "must be a non-empty string or a non-empty list of token ids")
        vocab_size = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab_size})")
        return prompt

    def chat_text(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The model's chat template applied, by default ready for the assistant's turn."""
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise InvalidRequestError("messages", "this model has no chat template")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list of {role, content} messages")
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidRequestError("messages", "each message needs a string 'role' and 'content'")
            content = message.get("content")
            if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
                raise InvalidRequestError("messages", "each message needs a string 'role' and 'content'")
        return self.tokenizer.render_chat(
            messages, add_generation_prompt, continue_final_message, tools, template_kwargs
        )

    def chat_prompt(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,  # the template writes the model's special tokens itself
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The conversation as text (the chat template applied) and as token ids."""
        text = self.chat_text(messages, add_generation_prompt, continue_final_message, tools, template_kwargs)
        assert self.tokenizer is not None
        return text, self.tokenizer.encode(text, add_special_tokens)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{num_prompt_tokens} prompt tokens + max_tokens {max_tokens} = {total} exceeds this model's "
                f"maximum context length of {self.max_model_len} tokens",
                code="context_length_exceeded",
            )

    def default_max_tokens(
        self, num_prompt_tokens: int, server_default: int | None, kv_pool_tokens: int | None = None
    ) -> int:
        """For a request without max_tokens: the rest of the context (OpenAI's default), or of a
        replica's whole KV pool if smaller, at most the server's default."""
        limit = min(self.max_model_len, kv_pool_tokens or self.max_model_len)
        room = max(1, limit - num_prompt_tokens)
        return min(server_default or room, room)
