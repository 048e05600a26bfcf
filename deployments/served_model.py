"""One model behind the Ingress: its engine (the handle of its EngineReplica deployment, or its
own in-process engine where colocated), its tokenizer and chat template, its LoRA adapters and
the sampling defaults its requests get. The Ingress holds one per model it serves and picks it by
the request's `model` (the model's name or one of its adapters')."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from ray.serve.handle import DeploymentHandle

from common.lora import LoRARequest
from common.messages import GenerateRequest
from common.model_source import ModelSource, generation_defaults, model_config_dict, resolve_model
from common.prompts import Prompt, PromptProcessor
from common.sampling_params import SamplingParams
from common.tokenizer import Message
from deployments import replica_calls
from deployments.disaggregated_engine import DisaggregatedEngine, PrefillDecode
from deployments.in_process_engine import ColocatedReplica, InProcessEngine, build_in_process_engine
from deployments.logprobs_format import LogprobsFormat
from deployments.lora_registry import LoraRegistry, LoraSettings
from deployments.responses import Endpoint

ENGINE_CALL_TIMEOUT_S = 5.0  # a health check, or asking a replica its KV pool's size


@dataclass(frozen=True)
class ModelSettings:
    """What the Ingress needs of one model (AppArgs' per-model settings)."""

    model: str  # where the model comes from (EngineConfig.model): its tokenizer and context
    model_name: str  # the `model` clients send
    max_model_len: int | None = None  # EngineConfig.max_model_len: prompt + output cap
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # a file or the template: replaces the model's own
    tool_call_parser: str | None = None  # how calls are read from the text (common.tool_parsers)
    lora: LoraSettings = field(default_factory=LoraSettings)  # the adapters `model` may name
    reasoning_parser: str | None = None  # how chat answers' reasoning is read (common.reasoning_parsers)
    model_generation_config: bool = True  # the model's generation_config.json under sampling_defaults
    aliases: tuple[str, ...] = ()  # more names `model` may give it (not listed by /v1/models)


def sampling_defaults(source: ModelSource, settings: ModelSettings) -> dict[str, Any]:
    """What fills the sampling fields a request leaves out: the app's `sampling_defaults` over the
    model's generation_config.json (vLLM's `--generation-config auto`), unless turned off."""
    model_defaults = generation_defaults(source) if settings.model_generation_config else {}
    SamplingParams(**model_defaults)  # a bad value fails the replica's start, naming the field
    return {**model_defaults, **settings.sampling_defaults}


class ServedModel:
    def __init__(
        self, engine: DeploymentHandle | ColocatedReplica | PrefillDecode, settings: ModelSettings
    ) -> None:
        # its own engine (ingress: colocated), the EngineReplica deployment's handle, or the
        # handles of its prefill and decode deployments
        self.engine: Any = engine
        if isinstance(engine, ColocatedReplica):
            self.engine = build_in_process_engine(engine)
        elif isinstance(engine, PrefillDecode):
            by_value = replica_calls.by_value
            self.engine = DisaggregatedEngine(
                replace(engine, prefill=by_value(engine.prefill), decode=by_value(engine.decode))
            )
        else:
            self.engine = replica_calls.by_value(engine)
        source = resolve_model(settings.model)
        self.prompts = PromptProcessor.load(source, settings.max_model_len, settings.chat_template)
        model_config = model_config_dict(source)
        self.hidden_size = model_config["hidden_size"]  # what embeddings measure
        self.tool_call_parser = settings.tool_call_parser
        self.reasoning_parser = settings.reasoning_parser
        self.model_name = settings.model_name
        self.lora = LoraRegistry(settings.model_name, model_config, settings.lora, settings.aliases)
        self.model_root = settings.model  # where the model came from, as vLLM's /v1/models says
        self.sampling_defaults = sampling_defaults(source, settings)
        self._kv_pool_tokens: int | None = None  # a replica's whole KV pool, asked once
        # a token's text, for logprobs: the same few thousand tokens come up again and again
        self._token_text = functools.lru_cache(maxsize=1 << 16)(lambda token_id: self.decode([token_id]))

    @property
    def colocated(self) -> bool:
        return isinstance(self.engine, InProcessEngine)

    def serves(self, model: str) -> bool:
        """Whether `model` names this model (by its name or an alias) or one of its adapters."""
        return self.lora.knows(model)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 model_not_found if this model
        serves no such name, 400 naming `model` if its adapter's files cannot run."""
        return self.lora.resolve(model)

    def cards(self, created: int) -> list[dict[str, object]]:
        """/v1/models' entries: the model, then its adapters."""
        card = {"id": self.model_name, "object": "model", "created": created, "owned_by": "stallfree"}
        # vLLM's fields (adapters name this parent); max_model_len: the context a request may fill
        card |= {"root": self.model_root, "parent": None, "max_model_len": self.prompts.max_model_len}
        return [card, *self.lora.cards(created)]

    async def pool_tokens(self) -> int | None:
        """Tokens one replica's KV pool holds (replicas of a deployment are alike), asked of a
        replica once; None while none answers (the context alone then bounds max_tokens)."""
        if self._kv_pool_tokens is None:
            with contextlib.suppress(Exception):
                call = self.engine.kv_pool_tokens.remote()
                self._kv_pool_tokens = await asyncio.wait_for(call, ENGINE_CALL_TIMEOUT_S)
        return self._kv_pool_tokens

    def generate_request(
        self,
        sampling: dict[str, Any],
        kv_pool_tokens: int | None,
        prompts: list[Prompt] | None = None,
        conversation: list[Message] | None = None,
        template: dict[str, Any] | None = None,  # chat_prompt's options (ChatCompletionRequest.template)
    ) -> GenerateRequest:
        """The request tokenized, its `sampling` (the body's, checked) fitted to each prompt; a
        bad input is a 400 naming its field (InvalidRequestError's handler), answered before any
        replica is asked."""
        if conversation is not None:
            text, ids = self.prompts.chat_prompt(conversation, **(template or {}))
            texts, prompt_token_ids = [text], [ids]
        else:
            # token ids written out: a text-matching router still sees shared prefixes
            texts = [p if isinstance(p, str) else " ".join(map(str, p)) for p in prompts or []]
            prompt_token_ids = [self.prompts.tokenize(p) for p in prompts or []]
        params = [self._params(sampling, len(ids), kv_pool_tokens) for ids in prompt_token_ids]
        return GenerateRequest(uuid.uuid4().hex, prompt_token_ids, params, "\n".join(texts))

    def _params(
        self, sampling: dict[str, Any], num_prompt_tokens: int, kv_pool_tokens: int | None
    ) -> SamplingParams:
        """max_tokens: the request's, else the server's default fitted to the room left."""
        if sampling.get("max_tokens") is None:
            server_default = self.sampling_defaults.get("max_tokens")
            default = self.prompts.default_max_tokens(num_prompt_tokens, server_default, kv_pool_tokens)
            sampling = {**sampling, "max_tokens": default}
        params = SamplingParams(**sampling)
        self.prompts.check_fits(num_prompt_tokens, params.max_tokens)
        return params

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text; a model without a tokenizer writes them as vLLM does, token_id:N."""
        tokenizer = self.prompts.tokenizer
        if tokenizer is None:
            return "".join(f"token_id:{token_id}" for token_id in token_ids)
        return tokenizer.decode(token_ids)

    def logprobs_format(self, endpoint: Endpoint, asked: bool) -> LogprobsFormat | None:
        return LogprobsFormat(self._token_text, endpoint.is_chat) if asked else None
