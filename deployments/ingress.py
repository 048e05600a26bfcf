"""Ingress: the OpenAI-compatible HTTP API (FastAPI inside Serve), in front of the EngineReplicas.

It parses and checks requests, tokenizes them (the chat template applied), decides max_tokens,
asks a replica through a streaming DeploymentHandle with token ids, and writes OpenAI bodies or
Server-Sent Events; vLLM's /tokenize, /detokenize and /tokenizer_info answer from its tokenizer alone
(deployments/tokenize_api.py); /v1/embeddings asks a replica for pooled vectors
(deployments/embeddings_api.py); LoRA adapters are named by `model` (deployments/lora_registry.py).
It imports no torch (tests/common/test_common.py checks): the
model lives in the replicas, and the router that runs in this process sees exact prompt lengths.
With `ingress: colocated` the Ingress builds its own engine replica (in_process_engine.py) instead:
no router, no Ray hop."""

import asyncio
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
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
from common.startup_heap import freeze_startup_heap
from deployments import embeddings_api, replica_calls, tokenize_api
from deployments.auth import check_api_key, load_api_keys
from deployments.disaggregated_engine import PrefillDecode
from deployments.http_metrics import MODEL_LABEL, HttpMetricsMiddleware
from deployments.in_process_engine import ColocatedReplica
from deployments.logprobs_format import EchoedPrompt
from deployments.lora_registry import (
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    model_not_found,
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
from deployments.responses_api import ResponsesRequest, renamed_params
from deployments.responses_output import ResponseShape, ResponseStream
from deployments.served_model import ENGINE_CALL_TIMEOUT_S, ModelSettings, ServedModel

if TYPE_CHECKING:  # the engine's types: this process runs no engine (unless colocated)
    from replica_engine.outputs import EngineStats

logger = logging.getLogger("ray.serve")
VERSION = importlib.metadata.version("stallfree")

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
    """The app's own settings, for its one Ingress (each model's are its ModelSettings)."""

    api_key_env: str | None = None  # environment variable with comma-separated keys
    api_key_file: str | None = None  # file with one key per line
    max_request_body_bytes: int = 4 << 20
    request_timeout_s: float | None = None  # whole request, streamed or not; then 408 and abort


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Ingress:
    def __init__(
        self,
        models: list[tuple[DeploymentHandle | ColocatedReplica | PrefillDecode, ModelSettings]],
        settings: IngressSettings,
    ) -> None:
        # each model with its engine: its EngineReplica deployment's handle, or its own (colocated)
        self.models = [ServedModel(engine, model) for engine, model in models]
        SERVED[MODEL_LABEL] = self.models[0].model_name  # routes that name no model count here
        self.max_body_bytes = settings.max_request_body_bytes
        self.request_timeout_s = settings.request_timeout_s
        self.api_keys = load_api_keys(settings.api_key_env, settings.api_key_file)
        self.created = int(time.time())
        freeze_startup_heap()  # its event loop streams every token: no collection walks Ray's heap

    async def check_health(self) -> None:
        """Serve's periodic check: an Ingress with its own engine is as healthy as that engine."""
        for served in self.models:
            if served.colocated:
                await served.engine.check_health.remote()

    async def stats(self) -> "EngineStats":
        """The first model's engine's stats: its own (colocated), or one EngineReplica's (tests,
        tools)."""
        return await self.models[0].engine.stats.remote()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Called only where the deployment autoscales: an Ingress with its own engine (one
        model), as the EngineReplica deployment does (the KV-pressure policy reads these)."""
        return await self.models[0].engine.record_autoscaling_stats.remote()

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) name for the same check
    async def health(self) -> Response:
        try:
            for served in self.models:
                await asyncio.wait_for(served.engine.check_health.remote(), ENGINE_CALL_TIMEOUT_S)
        except Exception as error:
            raise ApiError(503, f"engine unavailable: {error}", error_type="server_error") from None
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models_list(self, request: Request) -> dict[str, object]:
        check_api_key(request.headers.get("authorization"), self.api_keys)
        return {"object": "list", "data": [card for m in self.models for card in m.cards(self.created)]}

    @app.get("/v1/models/{model:path}")
    async def model_card(self, request: Request, model: str) -> dict[str, object]:
        """OpenAI's models.retrieve: the card /v1/models lists under that id (an alias: the
        model's own card), else 404 model_not_found."""
        check_api_key(request.headers.get("authorization"), self.api_keys)
        served, lora = self._served(request, model)
        cards = served.cards(self.created)
        wanted = served.model_name if lora is None else lora.name
        card = next((card for card in cards if card["id"] == wanted), None)
        if card is None:
            raise model_not_found(model)
        return card

    @app.get("/version")
    async def version(self) -> dict[str, str]:
        """vLLM's: the server's version (open, as /health is)."""
        return {"version": VERSION}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        body = parse_body(LoadLoraAdapterRequest, await self._read_body(request))
        return PlainTextResponse(self.models[0].lora.load(body))  # vLLM answers in plain text

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        body = parse_body(UnloadLoraAdapterRequest, await self._read_body(request))
        return PlainTextResponse(self.models[0].lora.unload(body))

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        body = parse_body(CompletionRequest, await self._read_body(request))
        prompts = body.prompts()
        served, lora = self._served(request, body.model)
        sampling = {**body.sampling(served.sampling_defaults), "lora": lora}
        generate = served.generate_request(sampling, await served.pool_tokens(), prompts)
        echoed = None
        if body.echo:
            pairs = zip(prompts, generate.prompt_token_ids, strict=True)
            echoed = [EchoedPrompt(p if isinstance(p, str) else served.decode(ids), ids) for p, ids in pairs]
        return await self._respond(
            served, generate, body, COMPLETIONS, echoed, echo_only=body.echo_only, model_name=body.model
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await self._read_body(request))
        return await self._chat(request, body)

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: answered as the chat completion it amounts to
        (deployments/responses_api.py), written back in its own shapes (responses_output.py)."""
        body = parse_body(ResponsesRequest, await self._read_body(request))
        with renamed_params():
            return await self._chat(request, body.chat_request(), body)

    async def _chat(
        self, request: Request, body: ChatCompletionRequest, responses: ResponsesRequest | None = None
    ) -> Response:
        served, lora = self._served(request, body.model)
        conversation = body.conversation()
        sampling = body.sampling(served.sampling_defaults, served.tool_call_parser, served.reasoning_parser)
        sampling["lora"] = lora
        pool_tokens = await served.pool_tokens()
        generate = served.generate_request(
            sampling, pool_tokens, conversation=conversation, template=body.template()
        )
        # calls are read out of the answer only where the grammar shaped them (tool_choice not none)
        mode, calls = body.tool_mode, None
        if served.tool_call_parser is not None and mode != "none":
            finish = FinishReason.STOP if mode == "named" else FinishReason.TOOL_CALLS
            calls = ToolCallReading(served.tool_call_parser, finish)
        return await self._respond(
            served,
            generate,
            body,
            CHAT,
            tool_calls=calls,
            reasoning_parser=served.reasoning_parser,
            include_reasoning=body.include_reasoning,
            model_name=body.model,
            responses=responses,
        )

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> tokenize_api.TokenizeResponse:
        body = tokenize_api.parse_tokenize(await self._read_body(request))
        served, _ = self._served(request, body.model)
        return tokenize_api.tokenize(served.prompts, body)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> tokenize_api.DetokenizeResponse:
        body = parse_body(tokenize_api.DetokenizeRequest, await self._read_body(request))
        served, _ = self._served(request, body.model)
        return tokenize_api.detokenize(served.prompts, body)

    @app.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request, model: str | None = None) -> dict[str, Any]:
        check_api_key(request.headers.get("authorization"), self.api_keys)
        served, _ = self._served(request, model)
        return tokenize_api.tokenizer_info(served.prompts)

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> embeddings_api.EmbeddingResponse:
        body = parse_body(embeddings_api.EmbeddingRequest, await self._read_body(request))
        served, lora = self._served(request, body.model)
        if lora is not None:
            raise ApiError(
                400,
                f"`{body.model}` is a LoRA adapter; embeddings come from the base model "
                f"`{served.model_name}` only",
                param="model",
            )
        embed = embeddings_api.embed_request(served.prompts, body, served.hidden_size)
        # Routed as generate is (the routers read the same fields); a stream of one item, so that
        # replica_calls.replies' deadline and errors hold for it too, and cancelling aborts its inputs.
        replica_call: DeploymentResponseGenerator = served.engine.options(stream=True).embed.remote(embed)
        try:
            embeddings = await anext(replica_calls.replies(replica_call, self._deadline()))
        finally:
            replica_calls.cancel(replica_call)
        assert isinstance(embeddings, Embeddings)
        return embeddings_api.response(body, served.model_name, embeddings)

    def _served(self, request: Request, model: str | None) -> tuple[ServedModel, LoRARequest | None]:
        """The model a request's `model` names (None: the first served), and the adapter it names
        (None: the base model); 404 model_not_found if we serve no such model, 400 naming `model`
        if its adapter's files cannot run. The HTTP metrics count the request under that model."""
        served = next((m for m in self.models if model is not None and m.serves(model)), self.models[0])
        request.state.model_name = served.model_name  # read by HttpMetricsMiddleware
        return served, served.resolve(model)

    def _deadline(self) -> float | None:
        """When a request started now times out (loop time), if request_timeout_s is set."""
        if self.request_timeout_s is None:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout_s

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

    async def _respond(
        self,
        served: ServedModel,
        generate: GenerateRequest,
        body: SamplingRequest,
        endpoint: Endpoint,
        echoed: list[EchoedPrompt] | None = None,
        echo_only: bool = False,
        tool_calls: ToolCallReading | None = None,
        reasoning_parser: str | None = None,
        include_reasoning: bool = True,
        model_name: str | None = None,
        responses: ResponsesRequest | None = None,
    ) -> Response:
        deadline = self._deadline()
        # The router hop: this handle's `.remote` asks the deployment's RequestRouter (router/,
        # attached by deployments/app.py `_routing`: kv_prefix by default) which EngineReplica
        # gets the request; it reads `generate`'s prompt token ids and the replicas' RoutingStats.
        # Serve's streaming call to a replica's generate: delta batches, or one GenerateError
        call = served.engine.options(stream=True)
        replica_call: DeploymentResponseGenerator = call.generate.remote(generate)
        replies = replica_calls.replies(replica_call, deadline)
        try:
            first = await anext(replies)  # the engine's verdict comes before any header is sent
        except BaseException:
            replica_calls.cancel(replica_call)
            raise
        model_name = model_name or served.model_name  # as the client named it: an adapter answers as itself
        shape = None if responses is None else ResponseShape(responses, generate.request_id, model_name)
        writer = ResponseWriter(
            endpoint,
            generate.request_id,
            model_name,
            Usage(generate.n),
            body.include_usage,
            body.return_token_ids,
            served.logprobs_format(endpoint, body.output_logprobs is not None),
            served.logprobs_format(endpoint, body.prompt_logprobs is not None),
            echoed,
            echo_only,
            generate.prompt_token_ids if body.return_token_ids else None,
            tool_calls,
            reasoning_parser,
            include_reasoning,
        )
        if body.stream:
            events = self._events(writer, first, replies, replica_call, shape)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            whole = await writer.whole(replica_calls.prepend(first, replies))
            return JSONResponse(whole if shape is None else shape.whole(whole))
        finally:  # a no-op once finished; aborts the request if it failed or was cancelled
            replica_calls.cancel(replica_call)

    @staticmethod
    async def _events(
        writer: ResponseWriter,
        first: list[ChoiceDelta],
        replies: AsyncIterator[list[ChoiceDelta]],
        replica_call: DeploymentResponseGenerator,
        shape: ResponseShape | None,
    ) -> AsyncIterator[str]:
        batches = replica_calls.prepend(first, replies)
        stream = None if shape is None else ResponseStream(shape)
        events = writer.events(batches) if stream is None else stream.events(writer.chunks(batches))
        try:
            async for event in events:
                yield event
        except Exception as error:  # headers are sent: the failure goes in the stream
            if not isinstance(error, ApiError):
                logger.exception("stream failed")
                error = ApiError(500, f"internal error: {error}", error_type="server_error")
            if stream is not None:
                yield stream.error(error)
                return
            yield sse_event(error.body)
            yield "data: [DONE]\n\n"
        finally:  # the client went away (CancelledError) or we are done: free the KV blocks
            replica_calls.cancel(replica_call)
