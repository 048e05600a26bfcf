"""vLLM's /tokenize, /detokenize and /tokenizer_info: the request and response bodies in vLLM's
shapes, and their answers from the Ingress's PromptProcessor, so a prompt or chat tokenizes to
exactly the ids the completion and chat endpoints send to the engine. Torch-free, like the Ingress."""

from __future__ import annotations

from typing import Annotated, Any

import pydantic_core
from pydantic import BaseModel, Field

from common.prompts import PromptProcessor
from common.tokenizer import PromptTokenizer
from deployments.protocol import ApiError, ChatMessage, parse_body, template_messages


class TokenizeCompletionRequest(BaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes the special tokens itself
    return_token_strs: bool | None = False
    # vLLM's, refused when set: each would change what the chat template writes
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def check_supported(self) -> None:
        for name in ("chat_template", "chat_template_kwargs", "tools"):
            if getattr(self, name):
                raise ApiError(400, f"{name}: not supported by this server", param=name)


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


def parse_tokenize(body: bytes) -> TokenizeRequest:
    """Either of vLLM's /tokenize bodies: `messages` makes it the chat form. A body that is not a
    JSON object is parsed as the text form, which refuses it in parse_body's words."""
    try:
        peek = pydantic_core.from_json(body)
    except ValueError:
        peek = None
    chat = isinstance(peek, dict) and "messages" in peek
    return parse_body(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)


def tokenize(prompts: PromptProcessor, request: TokenizeRequest) -> TokenizeResponse:
    """The prompt's token ids as the completion endpoint gets them, or the conversation's as the
    chat endpoint gets them (same defaults; the options are vLLM's)."""
    tokenizer = _tokenizer(prompts)
    if isinstance(request, TokenizeChatRequest):
        request.check_supported()
        conversation = template_messages(request.messages)
        _, ids = prompts.chat_prompt(
            conversation,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            add_special_tokens=request.add_special_tokens,
        )
    else:
        ids = prompts.tokenize(request.prompt, add_special_tokens=request.add_special_tokens)
    token_strs = tokenizer.token_strings(ids) if request.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=prompts.max_model_len, tokens=ids, token_strs=token_strs
    )


def detokenize(prompts: PromptProcessor, request: DetokenizeRequest) -> DetokenizeResponse:
    tokenizer = _tokenizer(prompts)
    vocab_size = tokenizer.vocab_size
    unknown = [token for token in request.tokens if token >= vocab_size]
    if unknown:
        raise ApiError(
            400, f"tokens: {unknown[:8]} are not in the vocabulary [0, {vocab_size})", param="tokens"
        )
    return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))


def tokenizer_info(prompts: PromptProcessor) -> dict[str, Any]:
    """The tokenizer's config (its special tokens, chat template, class): lm-eval's remote
    tokenizer reads it, with /tokenize and /detokenize, in place of a local copy of the tokenizer."""
    return _tokenizer(prompts).settings


def _tokenizer(prompts: PromptProcessor) -> PromptTokenizer:
    if prompts.tokenizer is None:
        raise ApiError(
            400,
            "this model has no tokenizer (dummy weights, or no tokenizer.json): nothing to tokenize with",
            param="model",
        )
    return prompts.tokenizer
