"""One request's state. The work it owes is `num_tokens - num_computed_tokens`: no phase flags.
Only the engine's step thread reads or changes it once the request is added.

Under async scheduling a request can be scheduled again while a batch holding it is still on its
way (in flight): the tokens of such batches are planned but not yet computed, and a token they
sample is a placeholder until its batch comes back (vLLM v1's output placeholders). The work owed
is then counted from what is planned: `num_tokens + placeholders - planned tokens`."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.block_hash import BlockHash
from common.finish_reason import FinishReason
from common.logprobs import TokenLogprob
from common.sampling_params import SamplingParams
from replica_engine.pooling import Pooling

if TYPE_CHECKING:
    import torch  # a seeded request's generator; the scheduler itself needs no torch

    from replica_engine.scheduler.plan import SamplingRow
    from replica_engine.structured import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # holds no KV blocks
    RUNNING = "running"  # admitted: holds KV blocks for its computed tokens
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: a request is a dict key in step plans
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()  # eos and chat-end ids, unless ignore_eos
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0  # the scheduler's count when added: FCFS among equal priorities
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0  # in batches sent to the runner whose outputs are not back yet
    num_output_placeholders: int = 0  # tokens those batches sample, not known yet
    block_ids: list[int] = field(default_factory=list)
    num_blocks_in_runner: int = 0  # of block_ids, how many the model runner holds (sent in a batch)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None
    last_token_time: float | None = None  # of the latest output token (TBT metrics)
    generator: torch.Generator | None = None  # per-request RNG when a seed is given
    block_hashes: list[BlockHash] = field(default_factory=list)  # keys of its first full blocks
    num_hashed_blocks: int = 0  # of its blocks, how many leading ones the prefix cache knows
    # Where the K/V its prefix-cache hit read ends: one past its computed tokens when it recomputes
    # the hit's last token (for the prompt logprob of the token after it), whose K/V is not written.
    prefix_hit_end: int = 0
    num_cached_tokens: int = 0  # prompt tokens found cached when first admitted
    num_expected_cached_tokens: int = 0  # found cached when it last entered the waiting queue
    grammar: RequestGrammar | None = None  # structured outputs: where its output is in its grammar
    sampling_row: SamplingRow | None = None  # how its tokens are sampled once no stop token is held back
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.., so far
    # An embedding request: its prompt is computed and pooled, nothing sampled (sampling_params
    # then only carries its cache salt and priority). `pooled`: its chunks' parts added up so far.
    pooling: Pooling | None = None
    pooled: torch.Tensor | None = None
    # Speculative decoding: draft tokens kept and drafts cut short, decayed (spec_decode/drafts.py
    # estimates the chance of the next one kept from them; one of each: a prior of one half).
    drafts_kept: float = 1.0
    drafts_rejected: float = 1.0
    # Prefill/decode disaggregation: export its prompt's full blocks when it finishes (a prefill
    # replica's request), or the blocks held for it since they were adopted from one, until its
    # admission takes them as prefix-cache hits (a decode replica's).
    kv_export: bool = False
    held_block_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Computed, or in a batch in flight: the position of the next token to schedule."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def num_owed_tokens(self) -> int:
        """Tokens to schedule: the known ones and the placeholders not yet planned; none once
        the placeholders reach max_tokens (the last of them ends the request)."""
        placeholders = self.num_output_placeholders
        if placeholders and len(self.output_token_ids) + placeholders >= self.sampling_params.max_tokens:
            return 0
        return self.num_tokens + placeholders - self.num_planned_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) of prompt + output, without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and has not had them all."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def computes_whole_prompt(self) -> bool:
        """Its prompt must be computed, not read from the prefix cache: it pools every token's
        hidden state (mean pooling)."""
        return self.pooling is not None and self.pooling.needs_every_token

    def append_output_token(self, token_id: int) -> FinishReason | None:
        """Record a sampled token; return why the request is done, if it is."""
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)  # the mask allowed only tokens it accepts
            if self.grammar.is_terminated:
                return FinishReason.STOP
        if token_id in self.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.sampling_params.max_tokens:
            return FinishReason.LENGTH
        return None
