"""What the engine returns: the step thread's token deltas (CoreOutput), the same with text once
detokenized (RequestDelta), a prompt's whole result offline as vLLM's (RequestOutput of
CompletionOutputs) or its embedding (EmbeddingOutput), and the gauges it publishes after each
step (EngineStats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from common.kv_transfer import KvBlocks
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


@dataclass(slots=True)  # not frozen: one for every row of every step, and frozen init costs 6x
class CoreOutput:
    """What one step did for one request, before detokenizing: its new token (none if it failed
    or was aborted) and, if it has finished, why. Read-only once made."""

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: FinishReason | None = None  # once finished
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token, if asked
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1..; with the first token
    embedding: list[float] | None = None  # an embedding request's, when it finishes
    kv: KvBlocks | None = None  # its prompt's blocks, when a request that exports them finishes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestDelta:
    """One request's progress: the new tokens and text since its last output (one step's, or
    several steps' where its reader fell behind: `then`)."""

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
    kv: KvBlocks | None = None  # a request that exports its prompt's blocks: in its final output

    def then(self, later: RequestDelta) -> RequestDelta:
        """This delta and the next one as one: what a reader that fell behind reads at once."""
        return RequestDelta(
            self.request_id,
            self.new_token_ids + later.new_token_ids,
            self.text_delta + later.text_delta,
            later.num_prompt_tokens,
            later.num_output_tokens,
            later.finished,
            later.finish_reason,
            later.num_cached_tokens,
            self.logprobs + later.logprobs,
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            later.embedding,
            later.kv,
        )


@dataclass
class CompletionOutput:
    """One choice of a finished request, accumulated from its RequestDeltas (vLLM's
    CompletionOutput: `index`, `text`, `token_ids`, `finish_reason`, `logprobs`)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, if asked

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the chosen tokens' logprobs (with logprobs asked, else None)."""
        return sum(lp.logprob for lp in self.logprobs) if self.logprobs else None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.text_delta
        self.token_ids.extend(delta.new_token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason


@dataclass
class RequestOutput:
    """One prompt's result offline (vLLM's RequestOutput): its `n` choices in `outputs`."""

    request_id: str
    prompt: str | None  # as given (None for token ids); a chat's, the template applied
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 1.., if asked

    @property
    def finished(self) -> bool:
        return all(choice.finished() for choice in self.outputs)

    def add(self, choice: int, delta: RequestDelta) -> None:
        self.outputs[choice].add(delta)
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


@dataclass(frozen=True)
class EmbeddingOutput:
    """One prompt's embedding (`LLM.embed`): float32 values, pooled as the engine's `pooling`
    setting says."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
