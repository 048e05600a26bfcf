"""Input processing: text or token ids in, a validated Request out, before anything reaches the
step thread. It reads only what never changes after start (tokenizer, context length, pool
size), so any thread may call it; a bad request is refused here, naming its field."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from replica_engine.config import EngineConfig
from replica_engine.errors import InvalidRequestError
from replica_engine.kv_cache_manager import blocks_for_tokens
from replica_engine.request import Request
from replica_engine.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


@dataclass(frozen=True)
class InputProcessor:
    config: EngineConfig  # resolved
    model_name: str
    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # None for dummy weights: token ids only
    stop_token_ids: frozenset[int]  # eos and chat-end ids
    num_kv_blocks: int  # blocks requests may hold

    @property
    def max_request_tokens(self) -> int:
        """Prompt + output tokens one request may have: the context, or the whole KV pool if smaller."""
        return min(self.config.max_model_len, self.num_kv_blocks * self.config.block_size)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Text through the tokenizer, or token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "prompt", "this model has no tokenizer (dummy weights): pass token ids"
                )
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError("prompt", "must be a non-empty string or a non-empty list of token ids")
        vocab_size = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab_size})")
        return prompt

    def chat_prompt_ids(self, messages: list[Message]) -> list[int]:
        """Apply the model's chat template, ready for the assistant's turn."""
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise InvalidRequestError("messages", "this model has no chat template")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list of {role, content} messages")
        for message in messages:
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)
            ):
                raise InvalidRequestError("messages", "each message needs a string 'role' and 'content'")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str) -> Request:
        """A new Request for the step thread, or InvalidRequestError naming what is wrong."""
        prompt_token_ids = self.tokenize(prompt)
        self._check_fits(len(prompt_token_ids), params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.stop_token_ids))
        request = Request(request_id, list(prompt_token_ids), params, frozenset(stop_ids))
        if params.seed is not None:
            request.generator = torch.Generator(device=self.config.torch_device).manual_seed(params.seed)
        return request

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        total = num_prompt_tokens + max_tokens
        if total > self.config.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{num_prompt_tokens} prompt tokens + max_tokens {max_tokens} = {total} exceeds this model's "
                f"maximum context length of {self.config.max_model_len} tokens",
                code="context_length_exceeded",
            )
        needed = blocks_for_tokens(total, self.config.block_size)
        if needed > self.num_kv_blocks:
            raise InvalidRequestError(
                "prompt",
                f"{total} tokens need {needed} KV blocks, but this replica's whole KV pool has "
                f"{self.num_kv_blocks}; it could never run",
                code="context_length_exceeded",
            )
