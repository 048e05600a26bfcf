"""Input processing: text or token ids in, a validated Request out, before anything reaches the
step thread. It reads only what never changes after start (tokenizer, context length, pool
size), so any thread may call it; a bad request is refused here, naming its field."""

from __future__ import annotations

import uuid
from collections.abc import Container
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from common.errors import InvalidRequestError
from common.lora import read_adapter
from common.prompts import Prompt, PromptProcessor
from common.sampling_params import SamplingParams
from replica_engine.config import EngineConfig
from replica_engine.kv_cache_manager import check_pool_fits
from replica_engine.pooling import Pooling
from replica_engine.request import Request
from replica_engine.structured import GrammarCompiler, RequestGrammar


@dataclass(frozen=True)
class InputProcessor:
    config: EngineConfig  # resolved
    model_name: str
    model_config: PretrainedConfig
    prompts: PromptProcessor  # tokenizing and the context check, as the Ingress does them
    tokenizer: PreTrainedTokenizerBase | None  # for detokenizing; None for dummy weights
    stop_token_ids: frozenset[int]  # eos and chat-end ids
    num_kv_blocks: int  # blocks requests may hold
    grammars: GrammarCompiler | None  # structured outputs; None without a tokenizer

    def compile_grammar(self, params: SamplingParams | None) -> RequestGrammar | None:
        """The request's grammar, compiled (None if it asks for none). Slow for a large schema:
        AsyncEngine calls this on a worker thread, never the step thread."""
        spec = params.structured_outputs if params is not None else None
        if spec is None:
            return None
        if self.grammars is None:
            raise InvalidRequestError(spec.param, "structured outputs need a tokenizer; this model has none")
        return self.grammars.compile(spec)

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        in_flight: Container[str],
        grammar: RequestGrammar | None = None,
    ) -> Request:
        """A new Request for the step thread (a fresh id unless the caller names one that is not
        `in_flight`), or InvalidRequestError naming what is wrong. A constrained request's
        `grammar` is compiled here unless the caller compiled it already (compile_grammar)."""
        request_id = _new_id(request_id, in_flight)
        params = params or SamplingParams()
        if params.n != 1:  # LLM.generate and the API send each choice as params.for_choice(j)
            raise InvalidRequestError("n", f"an engine request is one choice, got n={params.n}")
        prompt_token_ids = self._checked_prompt(prompt, params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
        bound = self.config.max_priority
        if bound is not None and abs(params.priority) > bound:
            raise InvalidRequestError(
                "priority", f"must be within [-{bound}, {bound}] (max_priority), got {params.priority}"
            )
        vocab_size = self.model_config.vocab_size
        if any(token_id >= vocab_size for token_id in params.logit_bias):
            raise InvalidRequestError(
                "logit_bias", f"token ids must be below the vocabulary size {vocab_size}"
            )
        if params.lora is not None:
            self._check_adapter(params)
        if grammar is None:
            grammar = self.compile_grammar(params)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.stop_token_ids))
        request = Request(request_id, list(prompt_token_ids), params, frozenset(stop_ids), grammar=grammar)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.config.torch_device).manual_seed(params.seed)
        return request

    def _check_adapter(self, params: SamplingParams) -> None:
        """Refuse a request whose adapter cannot run here, before it reaches the step."""
        assert params.lora is not None
        if not self.config.enable_lora:
            raise InvalidRequestError(
                "model", f"{params.lora.name!r} is a LoRA adapter; this engine has enable_lora off"
            )
        read_adapter(params.lora, self.model_config, self.config.max_lora_rank)

    def make_embedding_request(
        self, prompt: Prompt, request_id: str | None, in_flight: Container[str]
    ) -> Request:
        """A prompt-only request: its prompt is scheduled (and chunked) like any other, pooled
        as the engine's settings say, and it finishes without sampling."""
        request_id = _new_id(request_id, in_flight)
        prompt_token_ids = self._checked_prompt(prompt, 0)
        pooling = Pooling(self.config.pooling, self.config.normalize_embeddings)
        # Nothing is sampled: the default params only give it no cache salt and priority 0.
        return Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=1), pooling=pooling)

    def _checked_prompt(self, prompt: Prompt, max_tokens: int) -> list[int]:
        """The prompt's token ids, if it and `max_tokens` more fit the context and the KV pool."""
        prompt_token_ids = self.prompts.tokenize(prompt)
        self.prompts.check_fits(len(prompt_token_ids), max_tokens)
        check_pool_fits(len(prompt_token_ids) + max_tokens, self.config.block_size, self.num_kv_blocks)
        return prompt_token_ids


def _new_id(request_id: str | None, in_flight: Container[str]) -> str:
    """The caller's id (refused if a request in flight has it), or a fresh one."""
    request_id = request_id or uuid.uuid4().hex
    if request_id in in_flight:
        raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
    return request_id
