"""What the Ingress and an EngineReplica send each other through a DeploymentHandle.

Plain dataclasses with no torch import: the Ingress and the router build and read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from common.kv_transfer import KvHandle
from common.logprobs import TokenLogprob
from common.lora import LoRARequest
from common.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    """One HTTP request, tokenized and checked by the Ingress: prompts as token ids, each answered
    `n` times (its params' `n`). `params[i]` is prompt i's sampling, max_tokens decided (the
    request's, else the server default fitted to the context the prompt leaves)."""

    request_id: str
    prompt_token_ids: list[list[int]]
    params: list[SamplingParams]
    # The prompts as text (chat: the chat template applied; token ids: written out), for routers
    # that match text: Ray's PrefixCacheAffinityRouter reads a `prompt` attribute (and never
    # answers a request whose text is empty: it divides by its length).
    prompt: str = ""
    # Prefill/decode disaggregation: per prompt, where a prefill replica published its KV blocks
    # (None: that prompt is computed by the replica that gets this); None: no prefill ran.
    kv_handles: list[KvHandle | None] | None = None

    @property
    def wants_prefill(self) -> bool:
        """Whether a prefill replica may compute its prompts: not where prompt logprobs are
        asked (they are computed where the request runs, never read from the cache)."""
        return all(params.prompt_logprobs is None for params in self.params)

    @property
    def n(self) -> int:
        """Choices per prompt (the Ingress sets every prompt's alike)."""
        return self.params[0].n if self.params else 1

    def requested_tokens(self) -> int:
        """Prompt + output tokens this request may hold in KV cache, all choices together."""
        pairs = zip(self.prompt_token_ids, self.params, strict=True)
        return self.n * sum(len(ids) + params.max_tokens for ids, params in pairs)

    @property
    def cache_salt(self) -> str | None:
        return self.params[0].cache_salt if self.params else None

    @property
    def lora(self) -> LoRARequest | None:
        """The LoRA adapter it runs with (the Ingress sets one for every prompt alike)."""
        return self.params[0].lora if self.params else None


@dataclass
class ChoiceDelta:
    """New tokens of one choice since its last delta."""

    index: int
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # of the prompt, found in the replica's prefix cache
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, if asked
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., in the first delta if asked


@dataclass
class GenerateError:
    """Why a request ends without its answer: sent instead of any delta when the engine refuses
    it (400), or in place of the rest when the engine fails while serving it (500, 503)."""

    message: str
    param: str | None
    code: str | None
    status: int = 400


@dataclass
class EmbedRequest:
    """One /v1/embeddings request, tokenized and checked by the Ingress: each input as token ids.
    Routed as a GenerateRequest is (the routers read the same fields): its prompts hold KV blocks
    while they run, and nothing more."""

    request_id: str
    prompt_token_ids: list[list[int]]
    prompt: str = ""  # the inputs as text, for routers that match text (see GenerateRequest)

    @property
    def n(self) -> int:
        """Choices per prompt (the Ingress sets every prompt's alike)."""
        return self.params[0].n if self.params else 1

    def requested_tokens(self) -> int:
        """Tokens its inputs hold in KV cache while they run."""
        return sum(len(ids) for ids in self.prompt_token_ids)

    @property
    def cache_salt(self) -> None:
        """None: embeddings share the prefix cache with every unsalted request."""
        return None

    @property
    def lora(self) -> None:
        """None: embeddings run on the base model."""
        return None


@dataclass
class Embeddings:
    """A replica's answer to an EmbedRequest: one vector per input, in input order (float32
    values, pooled and normalized as the replica's engine settings say)."""

    vectors: list[list[float]]
    num_prompt_tokens: int  # of every input together


RoutedMessage = GenerateRequest | EmbedRequest  # what the routers rank replicas for
