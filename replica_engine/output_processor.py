"""Output processing: the step thread's token deltas become text, off the step's critical path.

Each request has a RequestState on the side that reads its outputs (the offline loop, or the
event loop of an AsyncEngine stream): its detokenizer, stop strings and what it has delivered.
A stop string found here finishes the request for its reader at once and tells the engine through
the state's `on_stop_string` (LLMEngine directly, AsyncEngine by a message to its core), which
frees the blocks."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from common.finish_reason import FinishReason
from common.logprobs import TokenLogprob
from replica_engine.detokenizer import IncrementalDetokenizer
from replica_engine.outputs import CoreOutput, RequestDelta
from replica_engine.request import Request


class RequestState:
    def __init__(
        self,
        request: Request,
        tokenizer: PreTrainedTokenizerBase | None,
        on_stop_string: Callable[[], None],
    ) -> None:
        self.request_id = request.request_id
        self.on_stop_string = on_stop_string  # the engine still runs the request: stop it
        self.num_prompt_tokens = request.num_prompt_tokens
        params = request.sampling_params
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer,
                request.prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
            if tokenizer is not None and request.pooling is None  # an embedding has no text
            else None
        )
        # the token that stops a request (eos, stop_token_ids) is in its ids, not its text (vLLM's)
        self._untold_stop_ids = frozenset() if params.include_stop_str_in_output else request.stop_token_ids
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, output: CoreOutput) -> RequestDelta | None:
        """The user's view of one step's output; None once this request has already finished
        here (an abort or a stop string overtook what the engine was still computing)."""
        if self.finished:
            return None
        self.num_cached_tokens = output.num_cached_tokens
        new_token_ids: list[int] = []
        finish_reason = output.finish_reason
        last = len(output.new_token_ids) - 1
        for index, token_id in enumerate(output.new_token_ids):
            new_token_ids.append(token_id)
            untold = (
                index == last and finish_reason is FinishReason.STOP and token_id in self._untold_stop_ids
            )
            if self.detokenizer is not None and not untold and self.detokenizer.add_token(token_id):
                finish_reason = FinishReason.STOP
                if not output.finished:
                    self.on_stop_string()
                break
        logprobs = output.new_logprobs[: len(new_token_ids)]  # none past a stop string
        delta = self._output(new_token_ids, finish_reason, logprobs, output.prompt_logprobs, output.embedding)
        delta.kv = output.kv
        return delta

    def finish(self, reason: FinishReason) -> RequestDelta | None:
        """End the request here (abort, timeout): the last output, with any held-back text."""
        return None if self.finished else self._output([], reason)

    def _output(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
        embedding: list[float] | None = None,
    ) -> RequestDelta:
        self.num_output_tokens += len(new_token_ids)
        self.finish_reason = finish_reason
        finished = finish_reason is not None
        delta = self.detokenizer.take_delta(finished) if self.detokenizer is not None else ""
        return RequestDelta(
            request_id=self.request_id,
            new_token_ids=new_token_ids,
            text_delta=delta,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            finished=finished,
            finish_reason=finish_reason,
            num_cached_tokens=self.num_cached_tokens,
            logprobs=logprobs or [],
            prompt_logprobs=prompt_logprobs,
            embedding=embedding,
        )
