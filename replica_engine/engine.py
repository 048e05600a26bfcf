"""The engine of one replica: schedule -> run the flat batch -> sample -> update, one step at a time.

Thread-safe where it must be: `add_request`, `abort_request` and `stats` may be called from
another thread while `step` runs; the model forward itself runs outside the lock."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from replica_engine.attention import get_backend
from replica_engine.config import EngineConfig
from replica_engine.detokenizer import IncrementalDetokenizer
from replica_engine.errors import InvalidRequestError, StepFailedError
from replica_engine.kv_cache_manager import KVCacheManager, blocks_for_tokens
from replica_engine.model_runner import ModelRunner
from replica_engine.models.loader import load_config, load_model
from replica_engine.models.sources import resolve_model
from replica_engine.outputs import RequestOutput
from replica_engine.request import FinishReason, Request
from replica_engine.sampling_params import SamplingParams
from replica_engine.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from replica_engine.scheduler.plan import StepPlan, StepSummary

if TYPE_CHECKING:
    from replica_engine.metrics import EngineMetrics

logger = logging.getLogger(__name__)
Prompt = str | list[int]


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_waiting_prompt_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    num_preemptions: int


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    last_token_time: float | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, metrics: EngineMetrics | None = None) -> None:
        config = config or EngineConfig()
        source = resolve_model(config.model)
        model_config = load_config(source)
        self.config = config.resolve(model_config)
        self.model_name = source.name
        torch.manual_seed(self.config.seed)
        loaded = load_model(
            source,
            model_config,
            get_backend(self.config.attention_backend),
            self.config.torch_dtype,
            self.config.torch_device,
            self.config.max_model_len,
            self.config.seed,
        )
        self.model_config = model_config
        self.tokenizer = loaded.tokenizer
        self.stop_token_ids = loaded.stop_token_ids
        self.runner = ModelRunner(loaded.model, self.config)
        num_blocks = self.runner.num_kv_blocks()
        if num_blocks < 1:
            raise InvalidRequestError("kv_cache_bytes", "leaves no room for a single KV block")
        self.runner.allocate_kv_cache(num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, self.config.block_size)
        scheduler_config = SchedulerConfig(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.scheduler = SCHEDULING_POLICIES[self.config.scheduling_policy](scheduler_config, self.kv_cache)
        self.step_listeners: list[Callable[[StepSummary], None]] = []
        self._requests: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self.metrics = metrics
        self.record_stats()

    # -- requests -------------------------------------------------------------------------
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

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
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

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        params = params or SamplingParams()
        prompt_token_ids = self.tokenize(prompt)
        self._check_fits(len(prompt_token_ids), params.max_tokens)
        request_id = request_id or uuid.uuid4().hex
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.stop_token_ids))
        request = Request(request_id, prompt_token_ids, params, frozenset(stop_ids))
        if params.seed is not None:
            request.generator = torch.Generator(device=self.config.torch_device).manual_seed(params.seed)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
        elif params.stop:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
        with self._lock:
            if request_id in self._requests:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
            self._requests[request_id] = _Tracked(request, detokenizer)
            self.scheduler.add_request(request)
        self.record_stats()
        return request_id

    @property
    def max_request_tokens(self) -> int:
        """Prompt + output tokens one request may have: the context, or the whole KV pool if smaller."""
        return min(self.config.max_model_len, self.kv_cache.num_blocks * self.config.block_size)

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
        if needed > self.kv_cache.num_blocks:
            raise InvalidRequestError(
                "prompt",
                f"{total} tokens need {needed} KV blocks, but this replica's whole KV pool has "
                f"{self.kv_cache.num_blocks}; it could never run",
                code="context_length_exceeded",
            )

    def abort_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestOutput | None:
        """Stop a request now; its KV blocks are free when this returns. None if it is not in flight."""
        with self._lock:
            tracked = self._requests.pop(request_id, None)
            if tracked is None:
                return None
            self.scheduler.finish_request(tracked.request, reason)
            output = self._output(tracked, [])
            if self.metrics is not None:
                self.metrics.record_finished(tracked.request, time.monotonic())
        self.record_stats()
        return output

    def fail_all_requests(self) -> None:
        """The engine cannot go on: finish every request with reason error, freeing its blocks."""
        for request_id in list(self._requests):
            self.abort_request(request_id, FinishReason.ERROR)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        with self._lock:
            scheduler = self.scheduler
            return EngineStats(
                num_waiting=len(scheduler.waiting),
                num_running=len(scheduler.running),
                num_waiting_prompt_tokens=sum(r.num_owed_tokens for r in scheduler.waiting),
                num_free_blocks=self.kv_cache.num_free_blocks,
                num_total_blocks=self.kv_cache.num_blocks,
                kv_cache_usage=self.kv_cache.usage,
                num_preemptions=scheduler.num_preemptions,
            )

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that got a token or finished.
        A request whose computation fails is finished with reason `error`; the others go on.
        Raises StepFailedError (after finishing them) if every request of the step failed."""
        started = time.perf_counter()
        with self._lock:
            plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        plan, sampled, failed = self._execute(plan)
        with self._lock:
            advanced = self.scheduler.update(plan, sampled)
            now = time.monotonic()
            outputs = [self._advance(self._requests[r.request_id], now) for r in advanced]
        failed_outputs = [self.abort_request(r.request_id, FinishReason.ERROR) for r in failed]
        outputs += [output for output in failed_outputs if output is not None]
        if plan.is_empty:
            raise StepFailedError(outputs, failed)
        summary = plan.summary(duration_s=time.perf_counter() - started)
        for listener in self.step_listeners:
            listener(summary)
        if self.metrics is not None:
            self.metrics.record_step(summary)
        self.record_stats()
        return outputs

    def _execute(self, plan: StepPlan) -> tuple[StepPlan, list[int], list[Request]]:
        """Run the plan. If the batch raises, run each request's share alone to find the ones that
        fail (the rest of the work is redone: K/V slots are simply written again). Returns the
        plan of the requests that ran, their sampled tokens, and the failed requests."""
        try:
            return plan, self.runner.execute(plan), []
        except Exception:
            logger.exception("a step of %d requests failed", len(plan.num_scheduled_tokens))
        if len(plan.num_scheduled_tokens) == 1:
            return StepPlan(plan.token_budget, preempted=plan.preempted), [], list(plan.num_scheduled_tokens)
        tokens: dict[Request, list[int]] = {}
        failed: list[Request] = []
        for request, num_tokens in plan.num_scheduled_tokens.items():
            alone = StepPlan(plan.token_budget, {request: num_tokens})
            alone.seal()
            try:
                tokens[request] = self.runner.execute(alone)
            except Exception:
                logger.exception("request %s fails on its own", request.request_id)
                failed.append(request)
        survivors = StepPlan(
            plan.token_budget, {r: plan.num_scheduled_tokens[r] for r in tokens}, plan.preempted
        )
        survivors.seal()
        return survivors, [tokens[r][0] for r in survivors.sampling_requests], failed

    def _advance(self, tracked: _Tracked, now: float) -> RequestOutput:
        request = tracked.request
        new_token = request.output_token_ids[-1]
        if tracked.detokenizer is not None and tracked.detokenizer.add_token(new_token):
            self.scheduler.finish_request(request, FinishReason.STOP)
        if self.metrics is not None:
            self.metrics.record_token(request, now, tracked.last_token_time)
            if request.is_finished:
                self.metrics.record_finished(request, now)
        tracked.last_token_time = now
        if request.is_finished:
            del self._requests[request.request_id]
        return self._output(tracked, [new_token])

    def record_stats(self) -> None:
        """Publish the gauges (queue depth, running, KV usage) from the current state."""
        if self.metrics is not None:
            self.metrics.record_stats(self.stats())

    @staticmethod
    def _output(tracked: _Tracked, new_token_ids: list[int]) -> RequestOutput:
        request = tracked.request
        finished = request.is_finished
        delta = tracked.detokenizer.take_delta(finished) if tracked.detokenizer is not None else ""
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            text_delta=delta,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            finished=finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
        )
