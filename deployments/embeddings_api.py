"""OpenAI's /v1/embeddings: the request and response bodies, the request checked and tokenized
into an EmbedRequest for a replica (as the completion endpoint tokenizes its prompts), and the
replica's vectors written as OpenAI writes them: float lists, or base64 of little-endian float32.
Torch-free, like the Ingress."""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict

from common.errors import InvalidRequestError
from common.messages import Embeddings, EmbedRequest
from common.prompts import Prompt, PromptProcessor
from deployments.protocol import ApiError

MAX_INPUTS = 2048  # per request, as OpenAI's limit


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field we would ignore is refused by name

    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's own size: no matryoshka truncation
    user: str | None = None

    def prompts(self) -> list[Prompt]:
        """One input (text or token ids) or a batch of them, always as a list."""
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            return [given]  # type: ignore[list-item]
        if not given:
            raise ApiError(400, "input: must not be empty", param="input")
        if len(given) > MAX_INPUTS:
            raise ApiError(400, f"input: at most {MAX_INPUTS} inputs per request", param="input")
        return list(given)  # type: ignore[arg-type]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def embed_request(prompts: PromptProcessor, body: EmbeddingRequest, hidden_size: int) -> EmbedRequest:
    """The inputs as token ids for a replica; a bad input is a 400 naming its field, answered
    before any replica is asked."""
    if body.dimensions is not None and body.dimensions != hidden_size:
        raise ApiError(
            400,
            f"dimensions: this model's embeddings have {hidden_size} dimensions and cannot be "
            f"shortened; got {body.dimensions}",
            param="dimensions",
        )
    inputs = body.prompts()
    token_ids = [_tokenized(prompts, prompt) for prompt in inputs]
    # token ids written out: a text-matching router still sees shared prefixes
    texts = [p if isinstance(p, str) else " ".join(map(str, p)) for p in inputs]
    return EmbedRequest(uuid.uuid4().hex, token_ids, "\n".join(texts))


def _tokenized(prompts: PromptProcessor, prompt: Prompt) -> list[int]:
    """The completion endpoint's tokenizing and context check, its errors naming `input`."""
    try:
        token_ids = prompts.tokenize(prompt)
        prompts.check_fits(len(token_ids), 0)
    except InvalidRequestError as error:
        raise InvalidRequestError("input", error.message, error.code) from None
    return token_ids


def response(body: EmbeddingRequest, model_name: str, embeddings: Embeddings) -> EmbeddingResponse:
    data = [
        EmbeddingData(index=index, embedding=_encoded(vector, body.encoding_format))
        for index, vector in enumerate(embeddings.vectors)
    ]
    num_tokens = embeddings.num_prompt_tokens
    usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    return EmbeddingResponse(data=data, model=model_name, usage=usage)


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
