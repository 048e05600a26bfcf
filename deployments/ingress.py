"""Ingress: the OpenAI-compatible HTTP API (FastAPI inside Serve), in front of the EngineReplicas.

It parses and checks requests, tokenizes them (the chat template applied), decides max_tokens,
asks a replica through a streaming DeploymentHandle with token ids, and writes OpenAI bodies or
Server-Sent Events; vLLM's /tokenize and /detokenize answer from its tokenizer alone
(deployments/tokenize_api.py); /v1/embeddings asks a replica for pooled vectors
(deployments/embeddings_api.py); LoRA adapters are named by `model` (deployments/lora_registry.py).
It imports no torch (tests/common/test_common.py checks): the
model lives in the replicas, and the router that runs in this process sees exact prompt lengths.
With `ingress: colocated` the Ingress builds its own engine replica (in_process_engine.py) instead:
no router, no Ray hop."""

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.errors import InvalidRequestError
from common.finish_reason import FinishReason
from common.lora import LoRARequest
from common.messages import ChoiceDelta, Embeddings, GenerateRequest
from common.model_source import ModelSource, generation_defaults, model_config_dict, resolve_model
from common.prompts import Prompt, PromptProcessor
from common.sampling_params import SamplingParams
from common.tokenizer import Message
from deployments import embeddings_api, replica_calls, tokenize_api
from deployments.auth import check_api_key, load_api_keys
from deployments.http_metrics import MODEL_LABEL, HttpMetricsMiddleware
from deployments.in_process_engine import ColocatedReplica, InProcessEngine, build_in_process_engine
from deployments.logprobs_format import EchoedPrompt, LogprobsFormat
from deployments.lora_registry import (
    LoadLoraAdapterRequest,
    LoraRegistry,
    LoraSettings,
    UnloadLoraAdapterRequest,
)
from deployments.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    parse_body,
)
from deployments.responses import (
    CHAT,
    COMPLETIONS,
    Endpoint,
    ResponseWriter,
    ToolCallReading,
    Usage,
    sse_event,
)

if TYPE_CHECKING:  # the engine's types: this process runs no engine (unless colocated)
    from replica_engine.outputs import EngineStats

logger = logging.getLogger("ray.serve")
HEALTH_TIMEOUT_S = 5.0

app = FastAPI(title="stallfree", description="OpenAI-compatible LLM serving")
SERVED: dict[str, str] = {}  # the HTTP metrics' labels, set by the process's Ingress
app.add_middleware(HttpMetricsMiddleware, served=SERVED)


@app.exception_handler(ApiError)
async def _api_error(_: Request, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


@app.exception_handler(InvalidRequestError)
async def _invalid_request(_: Request, error: InvalidRequestError) -> JSONResponse:
    # Raised wherever a request is checked (prompts, sampling): a 400 naming the field.
    return await _api_error(_, ApiError(400, str(error), error.param, error.code))


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and methods: OpenAI's shape, not FastAPI's {"detail": ...}.
    return await _api_error(_, ApiError(error.status_code, str(error.detail)))


@app.exception_handler(Exception)
async def _server_error(_: Request, error: Exception) -> JSONResponse:
    logger.exception("request failed")
    return await _api_error(_, ApiError(500, f"internal error: {error}", error_type="server_error"))


@dataclass(frozen=True)
class IngressSettings:
    model: str  # where the model comes from (EngineConfig.model): its tokenizer and context
    model_name: str  # the `model` clients send
    max_model_len: int | None = None  # EngineConfig.max_model_len: prompt + output cap
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    api_key_env: str | None = None  # environment variable with comma-separated keys
    api_key_file: str | None = None  # file with one key per line
    max_request_body_bytes: int = 4 << 20
    request_timeout_s: float | None = None  # whole request, streamed or not; then 408 and abort
    chat_template: str | None = None  # a file or the template: replaces the model's own
    tool_call_parser: str | None = None  # how calls are read from the text (common.tool_parsers)
    lora: LoraSettings = field(default_factory=LoraSettings)  # the adapters `model` may name
    reasoning_parser: str | None = None  # how chat answers' reasoning is read (common.reasoning_parsers)
    model_generation_config: bool = True  # the model's generation_config.json under sampling_defaults


def sampling_defaults(source: ModelSource, settings: IngressSettings) -> dict[str, Any]:
    """What fills the sampling fields a request leaves out: the app's `sampling_defaults` over the
    model's generation_config.json (vLLM's `--generation-config auto`), unless turned off."""
    model_defaults = generation_defaults(source) if settings.model_generation_config else {}
    SamplingParams(**model_defaults)  # a bad value fails the replica's start, naming the field
    return {**model_defaults, **settings.sampling_defaults}


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Ingress:
    def __init__(self, engine: DeploymentHandle | ColocatedReplica, settings: IngressSettings) -> None:
        # its own engine (ingress: colocated), or the EngineReplica deployment's handle
        self.engine = build_in_process_engine(engine) if isinstance(engine, ColocatedReplica) else engine
        source = resolve_model(settings.model)
        self.prompts = PromptProcessor.load(source, settings.max_model_len, settings.chat_template)
        model_config = model_config_dict(source)
        self.hidden_size = model_config["hidden_size"]  # what embeddings measure
        self.tool_call_parser = settings.tool_call_parser
        self.reasoning_parser = settings.reasoning_parser
        self.model_name = settings.model_name
        SERVED[MODEL_LABEL] = settings.model_name
        self.lora = LoraRegistry(settings.model_name, model_config, settings.lora)
        self.model_root = settings.model  # where the model came from, as vLLM's /v1/models says
        self.sampling_defaults = sampling_defaults(source, settings)
        self.max_body_bytes = settings.max_request_body_bytes
        self.request_timeout_s = settings.request_timeout_s
        self.api_keys = load_api_keys(settings.api_key_env, settings.api_key_file)
        self._kv_pool_tokens: int | None = None  # a replica's whole KV pool, asked once
        self.created = int(time.time())
        # a token's text, for logprobs: the same few thousand tokens come up again and again
        self._token_text = functools.lru_cache(maxsize=1 << 16)(lambda token_id: self._decode([token_id]))

    async def check_health(self) -> None:
        """Serve's periodic check: an Ingress with its own engine is as healthy as that engine."""
        if isinstance(self.engine, InProcessEngine):
            await self.engine.check_health.remote()

    async def stats(self) -> "EngineStats":
        """The engine's stats: its own (colocated), or one EngineReplica's (tests, tools)."""
        return await self.engine.stats.remote()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Called only where the deployment autoscales: an Ingress with its own engine, as the
        EngineReplica deployment does (the KV-pressure policy reads these)."""
        return await self.engine.record_autoscaling_stats.remote()

    @app.get("/health")
    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.engine.check_health.remote(), HEALTH_TIMEOUT_S)
        except Exception as error:
            raise ApiError(503, f"engine unavailable: {error}", error_type="server_error") from None
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, object]:
        check_api_key(request.headers.get("authorization"), self.api_keys)
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "stallfree"}
        card |= {"root": self.model_root, "parent": None}  # vLLM's fields; adapters name this parent
        return {"object": "list", "data": [card, *self.lora.cards(self.created)]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        body = parse_body(LoadLoraAdapterRequest, await self._read_body(request))
        return PlainTextResponse(self.lora.load(body))  # vLLM answers in plain text

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        body = parse_body(UnloadLoraAdapterRequest, await self._read_body(request))
        return PlainTextResponse(self.lora.unload(body))

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        body = parse_body(CompletionRequest, await self._read_body(request))
        prompts = body.prompts()
        lora = self._check_model(body.model)
        sampling = {**body.sampling(self.sampling_defaults), "lora": lora}
        generate = self._generate_request(body, sampling, await self._pool_tokens(), prompts)
        echoed = None
        if body.echo:
            pairs = zip(prompts, generate.prompt_token_ids, strict=True)
            echoed = [EchoedPrompt(p if isinstance(p, str) else self._decode(ids), ids) for p, ids in pairs]
        return await self._respond(generate, body, COMPLETIONS, echoed, model_name=body.model)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await self._read_body(request))
        lora = self._check_model(body.model)
        conversation, tools = body.conversation(), body.template_tools()
        sampling = body.sampling(self.sampling_defaults, self.tool_call_parser, self.reasoning_parser)
        sampling["lora"] = lora
        pool_tokens = await self._pool_tokens()
        template = {"tools": tools, "template_kwargs": body.chat_template_kwargs}
        generate = self._generate_request(
            body, sampling, pool_tokens, conversation=conversation, template=template
        )
        # calls are read out of the answer only where the grammar shaped them (tool_choice not none)
        mode, calls = body.tool_mode, None
        if self.tool_call_parser is not None and mode != "none":
            finish = FinishReason.STOP if mode == "named" else FinishReason.TOOL_CALLS
            calls = ToolCallReading(self.tool_call_parser, finish)
        return await self._respond(
            generate,
            body,
            CHAT,
            tool_calls=calls,
            reasoning_parser=self.reasoning_parser,
            include_reasoning=body.include_reasoning,
            model_name=body.model,
        )

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> tokenize_api.TokenizeResponse:
        body = tokenize_api.parse_tokenize(await self._read_body(request))
        self._check_model(body.model)
        return tokenize_api.tokenize(self.prompts, body)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> tokenize_api.DetokenizeResponse:
        body = parse_body(tokenize_api.DetokenizeRequest, await self._read_body(request))
        self._check_model(body.model)
        return tokenize_api.detokenize(self.prompts, body)

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> embeddings_api.EmbeddingResponse:
        body = parse_body(embeddings_api.EmbeddingRequest, await self._read_body(request))
        if self._check_model(body.model) is not None:
            raise ApiError(
                400,
                f"`{body.model}` is a LoRA adapter; embeddings come from the base model "
                f"`{self.model_name}` only",
                param="model",
            )
        embed = embeddings_api.embed_request(self.prompts, body, self.hidden_size)
        # Routed as generate is (the routers read the same fields); a stream of one item, so that
        # replica_calls.replies' deadline and errors hold for it too, and cancelling aborts its inputs.
        replica_call: DeploymentResponseGenerator = self.engine.options(stream=True).embed.remote(embed)
        try:
            embeddings = await anext(replica_calls.replies(replica_call, self._deadline()))
        finally:
            replica_calls.cancel(replica_call)
        assert isinstance(embeddings, Embeddings)
        return embeddings_api.response(body, self.model_name, embeddings)

    def _deadline(self) -> float | None:
        """When a request started now times out (loop time), if request_timeout_s is set."""
        if self.request_timeout_s is None:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout_s

    def _check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 model_not_found if we serve no
        such model, 400 naming `model` if its adapter's files cannot run."""
        return self.lora.resolve(model)

    async def _read_body(self, request: Request) -> bytes:
        """The authorized caller's body, refused with 413 past the size limit (before reading it
        all when the client declares its length)."""
        check_api_key(request.headers.get("authorization"), self.api_keys)
        too_large = ApiError(
            413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large"
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def _pool_tokens(self) -> int | None:
        """Tokens one replica's KV pool holds (replicas of a deployment are alike), asked of a
        replica once; None while none answers (the context alone then bounds max_tokens)."""
        if self._kv_pool_tokens is None:
            with contextlib.suppress(Exception):
                call = self.engine.kv_pool_tokens.remote()
                self._kv_pool_tokens = await asyncio.wait_for(call, HEALTH_TIMEOUT_S)
        return self._kv_pool_tokens

    def _generate_request(
        self,
        body: SamplingRequest,
        sampling: dict[str, Any],
        kv_pool_tokens: int | None,
        prompts: list[Prompt] | None = None,
        conversation: list[Message] | None = None,
        template: dict[str, Any] | None = None,  # chat_prompt's tools and template_kwargs
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

    def _decode(self, token_ids: list[int]) -> str:
        """Token ids as text; a model without a tokenizer writes them as vLLM does, token_id:N."""
        tokenizer = self.prompts.tokenizer
        if tokenizer is None:
            return "".join(f"token_id:{token_id}" for token_id in token_ids)
        return tokenizer.decode(token_ids)

    def _logprobs_format(self, endpoint: Endpoint, asked: bool) -> LogprobsFormat | None:
        return LogprobsFormat(self._token_text, endpoint.is_chat) if asked else None

    async def _respond(
        self,
        generate: GenerateRequest,
        body: SamplingRequest,
        endpoint: Endpoint,
        echoed: list[EchoedPrompt] | None = None,
        tool_calls: ToolCallReading | None = None,
        reasoning_parser: str | None = None,
        include_reasoning: bool = True,
        model_name: str | None = None,
    ) -> Response:
        deadline = self._deadline()
        # The router hop: this handle's `.remote` asks the deployment's RequestRouter (router/,
        # attached by deployments/app.py `_routing`: kv_prefix by default) which EngineReplica
        # gets the request; it reads `generate`'s prompt token ids and the replicas' RoutingStats.
        # Serve's streaming call to a replica's generate: delta batches, or one GenerateError
        replica_call: DeploymentResponseGenerator = self.engine.options(stream=True).generate.remote(generate)
        replies = replica_calls.replies(replica_call, deadline)
        try:
            first = await anext(replies)  # the engine's verdict comes before any header is sent
        except BaseException:
            replica_calls.cancel(replica_call)
            raise
        writer = ResponseWriter(
            endpoint,
            generate.request_id,
            model_name or self.model_name,  # as the client named it: an adapter answers as itself
            Usage(generate.n),
            body.include_usage,
            body.return_token_ids,
            self._logprobs_format(endpoint, body.output_logprobs is not None),
            self._logprobs_format(endpoint, body.prompt_logprobs is not None),
            echoed,
            tool_calls,
            reasoning_parser,
            include_reasoning,
        )
        if body.stream:
            events = self._events(writer, first, replies, replica_call)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            return JSONResponse(await writer.whole(replica_calls.prepend(first, replies)))
        finally:  # a no-op once finished; aborts the request if it failed or was cancelled
            replica_calls.cancel(replica_call)

    @staticmethod
    async def _events(
        writer: ResponseWriter,
        first: list[ChoiceDelta],
        replies: AsyncIterator[list[ChoiceDelta]],
        replica_call: DeploymentResponseGenerator,
    ) -> AsyncIterator[str]:
        try:
            async for event in writer.events(replica_calls.prepend(first, replies)):
                yield event
        except Exception as error:  # headers are sent: the failure goes in the stream
            if not isinstance(error, ApiError):
                logger.exception("stream failed")
                error = ApiError(500, f"internal error: {error}", error_type="server_error")
            yield sse_event(error.body)
            yield "data: [DONE]\n\n"
        finally:  # the client went away (CancelledError) or we are done: free the KV blocks
            replica_calls.cancel(replica_call)
