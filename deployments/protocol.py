"""The OpenAI request bodies we accept, and the errors we answer with.

Bodies are parsed from raw JSON in strict mode, so "5" is not an integer and malformed JSON,
wrong types and missing fields all become one OpenAI-shaped 400 (never FastAPI's 422)."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.errors import InvalidRequestError
from common.sampling_params import MAX_LOGPROBS
from common.structured_outputs import StructuredOutputs
from deployments.chat_tools import (
    Tool,
    ToolCall,
    ToolChoice,
    check_tool_results,
    tool_calls_input,
    tool_grammar,
    tool_mode,
)


class ApiError(Exception):
    """An HTTP error with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
        self.headers = headers or {}


# Fields we accept only at their no-op values (None is always fine): anything else would change
# the answer in a way we do not implement, so the client hears about it.
_NO_OP_VALUES: dict[str, tuple[object, ...]] = {
    "top_logprobs": (0,),  # completions: `logprobs` is the count there
    "tools": ([],),  # completions (chat has its own)
    "echo": (False,),  # chat (vLLM's chat echo repeats the last message: not implemented)
    "suffix": ("",),
    "best_of": (1,),
    # vLLM's, not implemented here
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    "chat_template": (),  # chat (the server's `chat_template` setting sets it for every request)
    "documents": (),
    "prompt_embeds": (),
    "logits_processors": (),
    "vllm_xargs": ({},),
    "guided_whitespace_pattern": (),
}
# vLLM's older spellings of structured_outputs' kinds (vLLM 0.12 dropped them and now ignores
# them, which leaves output unconstrained; here they still constrain it)
GUIDED_KINDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


MAX_STOP_STRINGS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputs | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputs(json_object=True, param="response_format")
        if self.json_schema is None:
            raise ApiError(400, "response_format: json_schema is required", param="response_format")
        spec = self.json_schema
        return StructuredOutputs.from_schema(spec.schema_, bool(spec.strict), "response_format")


class StructuredOutputsRequest(BaseModel):
    """vLLM's structured_outputs: exactly one of these."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool | None = None

    def structured_outputs(self, param: str = "structured_outputs") -> StructuredOutputs:
        schema = self.json_
        return StructuredOutputs(
            json=schema if isinstance(schema, str) or schema is None else json.dumps(schema),
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=None if self.choice is None else tuple(self.choice),
            grammar=self.grammar,
            disable_any_whitespace=self.disable_any_whitespace,
            param=param,
        )


class SamplingRequest(BaseModel):
    """What completions and chat share: the model, sampling, stopping and streaming fields."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension, as are stop_token_ids and ignore_eos
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's, as is skip_special_tokens
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's: each choice (and chunk) also carries its token ids
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: a tenant's own prefix cache
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's, as are min_p, min_tokens, priority
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias
    prompt_logprobs: int | None = None  # vLLM's
    priority: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's
    guided_json: dict[str, Any] | str | None = None  # GUIDED_KINDS
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, unread: xgrammar is the one backend

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in _NO_OP_VALUES and value is not None and value not in _NO_OP_VALUES[name]:
                raise ApiError(400, f"{name}: not supported by this server", param=name)
        if self.stream and self.prompt_logprobs is not None:  # as vLLM
            raise ApiError(400, "prompt_logprobs: not available when stream is true", param="prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def output_logprobs(self) -> int | None:
        """Top logprobs per output token (None: no logprobs); each endpoint spells it its own way."""
        raise NotImplementedError

    def _structured_outputs(self) -> StructuredOutputs | None:
        from_format = self.response_format.structured_outputs() if self.response_format else None
        guided = {name: getattr(self, name) for name in GUIDED_KINDS if getattr(self, name) is not None}
        given = [
            name
            for name, spec in (
                ("response_format", from_format),
                ("structured_outputs", self.structured_outputs),
            )
            if spec is not None
        ] + list(guided)
        if len(given) > 1:
            raise ApiError(400, f"give one of {', '.join(given)}, not several", param=given[-1])
        if self.structured_outputs is not None:
            return self.structured_outputs.structured_outputs()
        if guided:
            ((name, value),) = guided.items()
            return StructuredOutputsRequest.model_validate({GUIDED_KINDS[name]: value}).structured_outputs(
                name
            )
        return from_format

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        if not all(key.isdigit() for key in self.logit_bias):
            raise ApiError(400, "logit_bias: keys must be token ids", param="logit_bias")
        return {int(key): bias for key, bias in self.logit_bias.items()}

    def sampling(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams fields: this request's, else the server's `defaults`. SamplingParams
        checks their ranges and names the bad one."""
        fields = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "cache_salt": self.cache_salt,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_p": self.min_p,
            "min_tokens": self.min_tokens,
            "logit_bias": self._logit_bias(),
            "logprobs": self.output_logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "structured_outputs": self._structured_outputs(),
            "priority": self.priority,
            "n": self.n,
        }
        # None means "the default": the server's, else SamplingParams'. max_tokens stays None: the
        # Ingress fits it (and the server's default) to the context the prompt leaves.
        server = {k: v for k, v in defaults.items() if k != "max_tokens"}
        sampling = {**server, **{k: v for k, v in fields.items() if v is not None}}
        sampling.setdefault("max_tokens", None)
        sampling["ignore_eos"] = self.ignore_eos
        sampling["include_stop_str_in_output"] = self.include_stop_str_in_output
        sampling["skip_special_tokens"] = self.skip_special_tokens
        return sampling


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 only with echo: the prompt alone comes back (scored: its logprobs), as OpenAI's legacy
    # API and vLLM answer it; evaluation harnesses score prompts so
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = None  # top logprobs per token (0: the chosen token's only)
    echo: bool | None = None  # the prompt comes back before the completion (its logprobs too)

    @property
    def output_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone."""
        return bool(self.echo) and self.max_tokens == 0

    def sampling(self, defaults: dict[str, Any]) -> dict[str, Any]:
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens: must be at least 1 (0 only with echo)", param="max_tokens")
        sampling = super().sampling(defaults)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            sampling["prompt_logprobs"] = self.logprobs  # echoed tokens come with theirs
        if self.echo_only:  # one token is computed (the prompt's last logits), and not sent
            sampling["max_tokens"] = 1
        return sampling

    def prompts(self) -> list[str | list[int]]:
        """One prompt (text or token ids) or a batch of them, always as a list."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        return list(prompt)  # type: ignore[arg-type]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant message with tool_calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers

    def as_template_input(self, index: int) -> dict[str, Any]:
        content = self.content
        if content is None and not (self.role == "assistant" and self.tool_calls):
            raise InvalidRequestError("messages", f"message {index}: content is required")
        if self.tool_calls and self.role != "assistant":
            raise InvalidRequestError("messages", f"message {index}: only assistant messages make tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise InvalidRequestError("messages", f"message {index}: a tool message needs its tool_call_id")
        text = content if isinstance(content, str) or content is None else "".join(p.text for p in content)
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = tool_calls_input(self.tool_calls, index)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """A conversation for the chat template, checked (each tool message answers an earlier call)."""
    rendered = [message.as_template_input(i) for i, message in enumerate(messages)]
    check_tool_results(rendered)
    return rendered


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template
    include_reasoning: bool = True  # vLLM's: with a reasoning parser, send reasoning_content
    # vLLM's: the template opens the assistant's turn; or leaves the last message open, for the
    # model to continue (a prefill of the answer)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named."""
        return tool_mode(self.tools, self.tool_choice)[0]

    @property
    def output_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs: must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise ApiError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def sampling(
        self, defaults: dict[str, Any], call_format: str | None = None, reasoning_parser: str | None = None
    ) -> dict[str, Any]:
        """As SamplingRequest's, and calls to the tools constrained to the format the server's
        tool_call_parser (`call_format`) reads. With a `reasoning_parser`, the model thinks freely
        first: any constraint holds after its thinking (as vLLM's)."""
        sampling = super().sampling(defaults)
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins over max_tokens
            sampling["max_tokens"] = self.max_completion_tokens
        mode, tools = tool_mode(self.tools, self.tool_choice)
        if mode != "none":
            if sampling.get("structured_outputs") is not None:
                raise InvalidRequestError(
                    "tool_choice",
                    "tools cannot be combined with response_format or structured_outputs (set it to none)",
                )
            if call_format is None:
                raise InvalidRequestError("tool_choice", f"{mode!r} needs the server's tool_call_parser set")
            grammar = tool_grammar(mode, tools, call_format, self.parallel_tool_calls is not False)
            sampling["structured_outputs"] = StructuredOutputs(tool_calls=grammar, param="tools")
        spec = sampling.get("structured_outputs")
        if spec is not None and reasoning_parser is not None:
            sampling["structured_outputs"] = dataclasses.replace(spec, after_reasoning=reasoning_parser)
        return sampling

    def conversation(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (all of them, whatever tool_choice says, as vLLM)."""
        return [tool.template_input() for tool in self.tools] if self.tools else None

    def template(self) -> dict[str, Any]:
        """How the chat template renders the conversation (PromptProcessor.chat_prompt's options)."""
        return {
            "tools": self.template_tools(),
            "template_kwargs": self.chat_template_kwargs,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


RequestModel = TypeVar("RequestModel", bound=BaseModel)


def parse_body(model: type[RequestModel], body: bytes) -> RequestModel:
    """Raw JSON -> a checked request (any body model), or ApiError(400) naming the first bad field."""
    try:
        request = model.model_validate_json(body, strict=True)
    except ValidationError as error:
        errors = error.errors(include_url=False)
        # A union field fails once per member; the member whose type matched says what is wrong.
        same_field = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
        first = next((e for e in same_field if not e["type"].endswith("_type")), errors[0])
        location = ".".join(str(part) for part in first["loc"])
        if first["type"] == "json_invalid":
            raise ApiError(400, f"request body is not valid JSON: {first['msg']}") from None
        param = str(first["loc"][0]) if first["loc"] else None
        raise ApiError(400, f"{location or 'body'}: {first['msg']}", param=param) from None
    if isinstance(request, SamplingRequest):
        request.check_supported()
    return request
