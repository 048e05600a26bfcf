"""What the engine returns: the step thread's token deltas (CoreOutput), the same with text once
detokenized (RequestOutput), a whole completion or an embedding offline (CompletionOutput,
EmbeddingOutput), and the gauges it publishes after each step (EngineStats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from common.logprobs import TokenLogprob


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine's queues and KV pool, readable from any thread."""

    num_waiting: int
    num_running: int
    num_pending_prompt_tokens: int  # to compute: waiting (net of cached prefixes) + running's unprefilled
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # held by requests; cached free blocks are not counted (evictable)
    num_preemptions: int
    num_cached_free_blocks: int  # free blocks the prefix cache still holds content in
    cached_block_hashes: tuple[bytes, ...] = ()  # prefix-cache keys of every block holding one
    lora_adapters: tuple[str, ...] = ()  # names of the LoRA adapters loaded, least recent first
    num_running_context_tokens: int = 0  # tokens the running requests attend to
    step_time_coefficients: tuple[float, ...] = ()  # the TBT budget's step-time model (none: empty)
    # Since the engine started, for rates (autoscaling): requests added and finished, and the
    # seconds of step time beyond the fastest step's (StepLoad).
    num_requests_added: int = 0
    num_requests_finished: int = 0
    step_work_s: float = 0.0


@dataclass(frozen=True)
class CoreOutput:
    """What one step did for one request, before detokenizing: its new token (none if it failed
    or was aborted) and, if it has finished, why."""

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: FinishReason | None = None  # once finished
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token, if asked
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1..; with the first token
    embedding: list[float] | None = None  # an embedding request's, when it finishes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's progress in one step: the new tokens and text since its last output."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    num_prompt_tokens: int
    num_output_tokens: int  # so far, including new_token_ids
    finished: bool = False
    finish_reason: FinishReason | None = None  # once finished
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache (OpenAI cached_tokens)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of new_token_ids, if asked
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., in the first output
    embedding: list[float] | None = None  # an embedding request's, in its final output


@dataclass
class CompletionOutput:
    """A whole completion, accumulated from a request's RequestOutputs."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, if asked
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 1.., if asked

    def add(self, output: RequestOutput) -> None:
        self.num_cached_tokens = output.num_cached_tokens
        self.text += output.text_delta
        self.token_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            self.finish_reason = output.finish_reason


@dataclass(frozen=True)
class EmbeddingOutput:
    """One prompt's embedding (`LLM.embed`): float32 values, pooled as the engine's `pooling`
    setting says."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
