"""The engine of one replica, driven by one thread: input processing -> EngineCore (schedule ->
execute -> update) -> output processing. `LLM` runs it offline; `AsyncEngine` builds the same
parts and runs the core apart (a process of its own, or a thread: core_client.py)."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from transformers import PretrainedConfig

from common.errors import InvalidRequestError
from common.finish_reason import FinishReason
from common.kv_transfer import KvBlocks
from common.model_source import ModelSource, resolve_model
from common.prompts import Prompt, PromptProcessor
from common.sampling_params import SamplingParams
from common.startup_heap import freeze_startup_heap
from common.tokenizer import Message
from replica_engine.config import EngineConfig
from replica_engine.engine_core import EngineCore
from replica_engine.errors import StepFailedError
from replica_engine.input_processor import InputProcessor
from replica_engine.model_runner import ModelRunner, load_runner
from replica_engine.models.loader import load_config, load_tokenizer
from replica_engine.models.moe import MoeShape
from replica_engine.output_processor import RequestState
from replica_engine.outputs import CoreOutput, EngineStats, RequestDelta
from replica_engine.parallel.executor import ParallelExecutor
from replica_engine.request import Request
from replica_engine.scheduler.step_time_model import ExpertRouting
from replica_engine.step_listeners import StepListener
from replica_engine.structured import GrammarCompiler

if TYPE_CHECKING:
    from replica_engine.metrics import EngineMetrics

__all__ = ["EngineStats", "LLMEngine", "Prompt", "build_core", "build_engine", "build_inputs"]


def _resolve(config: EngineConfig) -> tuple[ModelSource, PretrainedConfig, EngineConfig]:
    source = resolve_model(config.model)
    model_config = load_config(source)
    return source, model_config, config.resolve(model_config)


def build_core(config: EngineConfig, metrics: EngineMetrics | None) -> EngineCore:
    """Load the model and size the KV pool (the engine core's process, or the caller's); with a
    draft model, load it too, with a pool of as many blocks."""
    source, model_config, resolved = _resolve(config)
    runner: ModelRunner | ParallelExecutor = (
        load_runner(source, model_config, resolved)
        if resolved.num_workers == 1
        else ParallelExecutor(resolved, model_config.vocab_size)
    )
    num_kv_blocks = runner.num_kv_blocks()
    if num_kv_blocks < 1:
        param = "num_kv_blocks" if resolved.num_kv_blocks is not None else "kv_cache_bytes"
        raise InvalidRequestError(param, "leaves no room for a single KV block")
    spec = resolved.speculative
    proposer = None
    if spec is not None and spec.method == "draft_model":
        from replica_engine.spec_decode.draft_model import build_draft_proposer

        proposer = build_draft_proposer(config, resolved, spec, model_config.vocab_size, num_kv_blocks)
    moe = MoeShape.of(model_config)
    experts = ExpertRouting(moe.num_experts, moe.top_k) if moe is not None else None
    return EngineCore(resolved, runner, num_kv_blocks, metrics, proposer=proposer, experts=experts)


def build_inputs(config: EngineConfig, num_kv_blocks: int) -> InputProcessor:
    """The tokenizer, prompt checks and grammar compiler for a core of `num_kv_blocks` (any thread)."""
    source, model_config, config = _resolve(config)
    prompts = PromptProcessor.load(source, config.max_model_len)
    loaded = load_tokenizer(source)
    tokenizer = loaded.tokenizer
    grammars = (
        GrammarCompiler.for_tokenizer(
            tokenizer, model_config.vocab_size, loaded.stop_token_ids, not config.disable_any_whitespace
        )
        if tokenizer
        else None
    )
    return InputProcessor(
        config, source.name, model_config, prompts, tokenizer, loaded.stop_token_ids, num_kv_blocks, grammars
    )


def build_engine(config: EngineConfig, metrics: EngineMetrics | None) -> tuple[EngineCore, InputProcessor]:
    """The core (one owner) and its input processor (any thread)."""
    core = build_core(config, metrics)
    inputs = build_inputs(config, core.kv_cache_manager.num_blocks)
    freeze_startup_heap()
    return core, inputs


class LLMEngine:
    """Every method runs on the caller's thread, which owns the engine: aborts and stop strings
    take effect at once, between steps."""

    def __init__(self, config: EngineConfig | None = None, metrics: EngineMetrics | None = None) -> None:
        self.core, self.inputs = build_engine(config or EngineConfig(), metrics)
        # No router reads this engine's prefix-cache keys: taken once it is idle, not every step
        # (a tuple as long as the cached blocks, a GPU pool's tens of thousands).
        self.core.cached_hashes_every_s = math.inf
        self._states: dict[str, RequestState] = {}

    @property
    def config(self) -> EngineConfig:
        return self.inputs.config

    @property
    def model_config(self):
        return self.inputs.model_config

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    @property
    def step_listeners(self) -> list[StepListener]:
        return self.core.step_listeners

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.inputs.prompts.tokenize(prompt)

    def chat_prompt_ids(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.inputs.prompts.chat_prompt(messages, tools=tools, template_kwargs=template_kwargs)[1]

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        kv_export: bool = False,
        kv: KvBlocks | None = None,
    ) -> str:
        """Queue a request; `kv_export` and `kv` as AsyncEngine.add_request's."""
        request = self.inputs.make_request(prompt, params, request_id, in_flight=self._states)
        request.kv_export = kv_export
        return self._add(request, kv)

    def add_embedding_request(self, prompt: Prompt, request_id: str | None = None) -> str:
        """A prompt-only request: its final output carries the prompt's embedding."""
        return self._add(self.inputs.make_embedding_request(prompt, request_id, in_flight=self._states))

    def _add(self, request: Request, kv: KvBlocks | None = None) -> str:
        self.core.add_request(request, kv)
        self._states[request.request_id] = RequestState(
            request, self.inputs.tokenizer, functools.partial(self._end_by_stop_string, request.request_id)
        )
        self.core.publish_stats()
        return request.request_id

    def abort_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestDelta | None:
        """Stop a request now; its KV blocks are free when this returns. None if it is not in flight."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        self.core.abort_request(request_id, reason)
        self.core.publish_stats()
        return state.finish(reason)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.core.stats

    def step(self) -> list[RequestDelta]:
        """Run one iteration; return an output for every request that got a token or finished.
        A request whose computation fails is finished with reason `error`; the others go on.
        Raises StepFailedError (after finishing them) if every request of the step failed."""
        try:
            return self._process(self.core.step())
        except StepFailedError as failure:
            self._process(failure.outputs)
            raise

    def _process(self, core_outputs: list[CoreOutput]) -> list[RequestDelta]:
        outputs = []
        for core_output in core_outputs:
            output = self._states[core_output.request_id].process(core_output)
            if output is None:
                continue
            if output.finished:
                del self._states[core_output.request_id]
            outputs.append(output)
        return outputs

    def _end_by_stop_string(self, request_id: str) -> None:
        self.core.abort_request(request_id, FinishReason.STOP)
        self.core.publish_stats()
