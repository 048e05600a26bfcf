"""`AppArgs`: the `args:` of serve_config.yaml, typed and checked: a typo or a bad value fails the
deploy naming the field (deployments/app.py builds the application from them)."""

import dataclasses
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.model_source import DEFAULT_MODEL_HUB_ID, resolve_model, served_model_name
from common.tokenizer import template_source
from deployments.kv_connectors import DEFAULT_TTL_S
from deployments.llm_config import args_from_llm_config
from deployments.lora_registry import LoraSettings, check_lora_settings, parse_lora_modules
from replica_engine import DEFAULT_MODEL, EngineConfig, SamplingParams
from replica_engine.models.loader import load_config

# EngineConfig fields a deployment may set under `engine:` (model is its own arg; offline is for LLM).
ENGINE_KNOBS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {"model", "offline"}
# SamplingParams fields a server may default (stop and seed belong to a request).
SAMPLING_DEFAULTS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    }
)


# Settings of the app's one Ingress: beside `models`, never in an entry of it.
APP_SETTINGS = frozenset(
    {
        "models",
        "ingress",
        "ingress_replicas",
        "ingress_max_ongoing_requests",
        "api_key_env",
        "api_key_file",
        "max_request_body_bytes",
        "request_timeout_s",
    }
)


# What a role of `disaggregation` (its prefill or its decode deployment) may set over the model's.
ROLE_SETTINGS = frozenset(
    {
        "engine",
        "num_replicas",
        "autoscaling_config",
        "num_gpus",
        "num_cpus",
        "resources",
        "cpu_threads",
        "request_router",
        "max_ongoing_requests",
        "max_queued_requests",
        "target_kv_cache_usage",
        "target_waiting_requests",
        "target_ongoing_requests",
        "target_utilization",
        "backlog_drain_s",
    }
)
ROLE_ROUTERS = {"prefill": "kv_prefix", "decode": "kv_pressure"}  # where a role sets none


class Disaggregation(BaseModel):
    """`disaggregation:` prefill and decode in deployments of their own."""

    model_config = ConfigDict(extra="forbid")

    kv_connector: Literal["auto", "shared_memory", "tcp", "object_store"] = "auto"
    prefill_timeout_s: float = Field(default=30.0, gt=0)
    kv_ttl_s: float = Field(default=DEFAULT_TTL_S, gt=0)
    prefill: dict[str, Any] = Field(default_factory=dict)
    decode: dict[str, Any] = Field(default_factory=dict)

    @field_validator("prefill", "decode")
    @classmethod
    def _role_settings(cls, role: dict[str, Any]) -> dict[str, Any]:
        _check_known(role, ROLE_SETTINGS, "settings for a role")
        return role


def _located(error: ValidationError, prefix: str) -> ValueError:
    """A nested entry's first validation error, named from where the entry stands (`prefix`)."""
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    return ValueError(f"{prefix}{'.' + where if where else ''}: {first['msg']}")


def _check_known(given: dict[str, Any], known: frozenset[str], what: str) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {sorted(known)}")


class AppArgs(BaseModel):
    """The `args:` of serve_config.yaml. Every field's description is its row in the docs'
    generated settings table (docs/configuration.md)."""

    model_config = ConfigDict(extra="forbid")

    models: list[dict[str, Any]] | None = Field(
        default=None,
        description="Several models in one app (as Ray Serve LLM's `llm_configs`): each entry "
        "holds any of the settings here but the app's own (`ingress*`, `api_key*`, "
        "`max_request_body_bytes`, `request_timeout_s`), `llm_config` included, over the ones "
        "set beside `models`. One Ingress serves them all, picking the model by a request's "
        "`model` (a request that names none goes to the first) and listing every one in "
        "`/v1/models`; each model has its own engine replicas (deployments `EngineReplica-1`, "
        "`EngineReplica-2`, ...), autoscaling and request router",
    )
    llm_config: dict[str, Any] | None = Field(
        default=None,
        description="A Ray Serve LLM `LLMConfig` as its users write it (`model_loading_config`, "
        "`engine_kwargs`, `deployment_config`, `accelerator_type`, `placement_group_config`, "
        "`lora_config`), read into the settings here; a name with no match, or a setting given "
        "both here and there, fails the deploy by name (docs/migrating.md)",
    )
    model: str = Field(
        default=DEFAULT_MODEL,
        description="As `LLM(model=...)`: the embedded SmolLM2, a hub id (`org/name`, from the "
        "Hugging Face cache; fetched unless `HF_HUB_OFFLINE=1`), a local Hugging Face directory, a "
        "`.gguf` file, or `dummy:<shape>`",
    )
    served_model_name: str | list[str] | None = Field(
        default=None,
        description="The `model` clients send. A list: each is accepted, and answers carry the "
        "first (vLLM's `--served-model-name a b`). Default: derived from `model`; the embedded "
        f"default also answers to its hub id, `{DEFAULT_MODEL_HUB_ID}`",
    )
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine settings: any `EngineConfig` field but `model` and `offline` "
        "(`max_num_batched_tokens`, `max_num_seqs`, `kv_cache_bytes`, ...; table below)",
    )
    num_gpus: float = Field(
        default=0,
        ge=0,
        description="GPUs per engine worker, at most 1 (a worker drives one GPU; below 1, GPUs "
        "are shared): a replica of `tensor_parallel_size` x `pipeline_parallel_size` workers "
        "reserves that many times this, so a replica over N GPUs sets `num_gpus: 1` and "
        "`tensor_parallel_size: N`. Set it here only: a YAML `ray_actor_options` would replace "
        "the builder's options wholesale and silently drop it",
    )
    num_cpus: float = Field(
        default=1,
        ge=0,
        description="CPUs Ray reserves per engine worker (per replica when it has one worker)",
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        default="STRICT_PACK",
        description="A parallel replica's placement group (one bundle per worker): `STRICT_PACK` "
        "keeps it on one node; `PACK`, `SPREAD` and `STRICT_SPREAD` let its workers go to other "
        "nodes, which needs the engine's `distributed_executor_backend: ray`",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica, e.g. `{stallfree_engine: 1}` with nodes "
        "started by `ray start --resources='{\"stallfree_engine\": 1}'`: replicas go only to "
        "nodes that offer them",
    )
    cpu_threads: int | None = Field(
        default=None, ge=1, description="Torch threads of a CPU replica. Default: every core"
    )
    num_replicas: int | Literal["auto"] = Field(
        default=1,
        description="Engine replicas, or `auto`: our autoscaling policy (KV cache usage and the "
        "load the arriving requests bring, against the targets below), bounded by `autoscaling_config`",
    )
    autoscaling_config: dict[str, Any] | None = Field(
        default=None,
        description="Serve's autoscaling config (`min_replicas`, `max_replicas`, "
        "`upscale_delay_s`, `downscale_delay_s`, `look_back_period_s`, ...), used with "
        "`num_replicas: auto`; the policy is ours",
    )
    target_kv_cache_usage: float = Field(
        default=0.6, gt=0, le=1, description="Autoscaling target: mean KV cache usage per replica"
    )
    target_waiting_requests: float = Field(
        default=4, gt=0, description="Autoscaling target: mean queue depth per replica"
    )
    target_ongoing_requests: float = Field(
        default=4,
        gt=0,
        description="Autoscaling target: running + queued requests per replica "
        "(or Serve's `autoscaling_config.target_ongoing_requests`)",
    )
    target_utilization: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Autoscaling target: each replica's share of time in step work (step time beyond "
        "its fastest step's) that the arriving requests may fill",
    )
    backlog_drain_s: float = Field(
        default=30, gt=0, description="Autoscaling: replicas enough to drain the queued requests in this time"
    )
    request_router: Literal[
        "kv_prefix", "kv_pressure", "power_of_two", "round_robin", "prefix_cache_affinity"
    ] = Field(
        default="kv_prefix",
        description="`kv_prefix` (ours: prefix-cache overlap and KV load), `kv_pressure` (ours: "
        "KV load alone), or the baselines `power_of_two` (Serve's default), `round_robin` and "
        "`prefix_cache_affinity` (Ray Serve LLM's `PrefixCacheAffinityRouter`, unchanged)",
    )
    max_ongoing_requests: int = Field(
        default=128, ge=1, description="Requests one replica holds at once; its engine batches them"
    )
    max_queued_requests: int = Field(
        default=512,
        ge=-1,
        description="Requests waiting for a replica beyond this get 503 with `Retry-After` (-1: no cap)",
    )
    ingress: Literal["auto", "separate", "colocated"] = Field(
        default="auto",
        description="`colocated`: each replica serves HTTP itself (the API and its engine in one "
        "process), so a request and its tokens cross no Ray hop, but no request router picks a "
        "replica (HAProxy or Serve's proxy balances), and `request_router`, `ingress_replicas` and "
        "`ingress_max_ongoing_requests` do not apply; `separate`: an Ingress deployment (the OpenAI "
        "API) in front of the engine replicas, which `request_router` picks for each request; "
        "`auto`: colocated for one fixed replica (there is no replica to pick) unless one of those "
        "three is set, else separate",
    )
    ingress_max_ongoing_requests: int = Field(
        default=4096, ge=1, description="Concurrent HTTP requests per Ingress replica"
    )
    ingress_replicas: int = Field(
        default=1,
        ge=1,
        description="Ingress replicas, each with its own routers, at most one per node: with "
        "`proxy_location: EveryNode`, one per node keeps a request on the node whose proxy it "
        "entered (its node's Ingress takes it whenever one runs there). More than the cluster "
        "has nodes: the rest wait for nodes",
    )
    sampling_defaults: dict[str, Any] = Field(
        default_factory=dict,
        description="Sampling for the fields a request leaves out, e.g. `{temperature: 0.2, "
        "top_p: 0.9}`: over the model's `generation_config.json` (see `generation_config`), "
        "itself over OpenAI's defaults (temperature 1)",
    )
    generation_config: Literal["auto", "vllm"] = Field(
        default="auto",
        description="As vLLM's `--generation-config`: `auto` takes the model's "
        "`generation_config.json` sampling (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) for the fields a request leaves out; `vllm`: not it, only "
        "`sampling_defaults`",
    )
    api_key_env: str | None = Field(
        default=None,
        description="An environment variable, read on the Ingress's node, holding comma-separated "
        "API keys (`Authorization: Bearer`). Neither this nor `api_key_file`: no auth",
    )
    api_key_file: str | None = Field(
        default=None, description="A file on the Ingress's node with one API key per line"
    )
    max_request_body_bytes: int = Field(default=4 << 20, ge=1024, description="Larger request bodies get 413")
    request_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="A request still unanswered after this long (streamed or not) gets 408 "
        "`request_timeout` and is aborted, its KV blocks freed. None: no limit of ours "
        "(Serve's `http_options.request_timeout_s` still applies if set, with Serve's plain-text 408)",
    )

    chat_template: str | None = Field(
        default=None,
        description="A Jinja chat template, or a file holding one, instead of the model's own (vLLM's "
        "`--chat-template`). Requests with tools use the model's template when it renders tools, "
        "else, for a ChatML model (the embedded SmolLM2), ours: Hermes-style calls "
        "(`common/chat_templates/chatml_tools.jinja`)",
    )
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        default="hermes",
        description="How tool calls are written and read back (vLLM's `--tool-call-parser`): `hermes`, "
        '`<tool_call>{"name": ..., "arguments": ...}</tool_call>`; `llama3_json`, Llama 3.1\'s '
        '`{"name": ..., "parameters": ...}`. The calls are generated under a grammar that holds them '
        "to the tools' schemas. None: tools are only shown to the model (`tool_choice: none`)",
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        default=None,
        description="How a reasoning model's thinking is read out of its chat answers (vLLM's "
        "`--reasoning-parser`): the text inside `<think>...</think>` goes to the message's "
        "`reasoning_content`, the rest to `content` (and to the tool-call parser). `qwen3`: "
        "thinking only where the answer opens `<think>`; `deepseek_r1`: the answer starts "
        "inside it (its template opens it). None: the answer is all content",
    )

    disaggregation: Disaggregation | None = Field(
        default=None,
        description="Prefill/decode disaggregation (as Ray Serve LLM's `build_pd_openai_app`): "
        "prompts are computed on the replicas of a `PrefillReplica` deployment, whose KV blocks "
        "move to the replicas of a `DecodeReplica` deployment, which adopt them into their "
        "prefix caches and decode. `kv_connector`: `auto` (shared memory on one node, TCP "
        "between nodes), `shared_memory`, `tcp` or `object_store` (Ray's). `prefill:` and "
        "`decode:` each set their own `num_replicas`, `engine`, `autoscaling_config`, resources, "
        "`request_router` (defaults: `kv_prefix` for prefill, `kv_pressure` for decode; the "
        "model's own `request_router` does not apply to them) and "
        "autoscaling targets over the ones here. A prefill that fails, or has not answered within "
        "`prefill_timeout_s` (30), is computed by the decode replica instead, and requests skip "
        "prefill for 5 s. Blocks published for a request that ends before its decode replica answered "
        "are dropped then; any left unread, after `kv_ttl_s` (60; as vLLM's NIXL abort timeout). "
        "Not with parallel workers",
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters (PEFT directories) served by name, as vLLM's `--lora-modules`: "
        "`{name: path}` or `[name=path, ...]`. A request names one by `model`: `name` or "
        "`<served model>:name`. Each is checked against the model at deploy time. Turns on the "
        "engine's `enable_lora`",
    )
    lora_root: str | None = Field(
        default=None,
        description="A directory of LoRA adapters loaded on demand (Ray Serve LLM's "
        "`dynamic_lora_loading_path`): `model: x` runs the adapter in `<lora_root>/x`. Turns on "
        "the engine's `enable_lora`",
    )
    allow_runtime_lora_updating: bool = Field(
        default=False,
        description="vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: `POST /v1/load_lora_adapter` and "
        "`/v1/unload_lora_adapter` add and remove adapters by local path (on each Ingress replica "
        "alone). Turns on the engine's `enable_lora`",
    )

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_modules(cls, modules: object) -> dict[str, str]:
        return parse_lora_modules(modules)  # raises InvalidRequestError naming lora_modules

    @field_validator("served_model_name")
    @classmethod
    def _some_name(cls, names: str | list[str] | None) -> str | list[str] | None:
        if names == []:
            raise ValueError("an empty list names nothing")
        return names

    @field_validator("num_gpus")
    @classmethod
    def _one_gpu_per_worker(cls, num_gpus: float) -> float:
        if num_gpus > 1:
            n = f"{num_gpus:g}"
            raise ValueError(
                f"{n} GPUs per engine worker, but a worker drives one: for a replica over {n} GPUs "
                f"set num_gpus: 1 and engine.tensor_parallel_size: {n}"
            )
        return num_gpus

    @field_validator("lora_root")
    @classmethod
    def _absolute_root(cls, root: str | None) -> str | None:
        return None if root is None else os.path.abspath(os.path.expanduser(root))

    @field_validator("chat_template")
    @classmethod
    def _readable_template(cls, chat_template: str | None) -> str | None:
        if chat_template is not None:
            template_source(chat_template)  # raises InvalidRequestError naming chat_template
        return chat_template

    @field_validator("engine")
    @classmethod
    def _known_knobs(cls, engine: dict[str, Any]) -> dict[str, Any]:
        _check_known(engine, ENGINE_KNOBS, "engine settings")
        return engine

    @field_validator("sampling_defaults")
    @classmethod
    def _valid_sampling(cls, defaults: dict[str, Any]) -> dict[str, Any]:
        _check_known(defaults, SAMPLING_DEFAULTS, "sampling defaults")
        SamplingParams(**defaults)  # raises InvalidRequestError (a ValueError) naming the field
        return defaults

    def _separate_only_settings(self) -> list[str]:
        """The settings of the Ingress deployment that differ from their defaults."""
        fields = type(self).model_fields
        names = ("request_router", "ingress_replicas", "ingress_max_ongoing_requests")
        return [name for name in names if getattr(self, name) != fields[name].default]

    @model_validator(mode="before")
    @classmethod
    def _from_llm_config(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("llm_config") is None:
            return data
        mapped = args_from_llm_config(data["llm_config"])
        engine = dict(data.get("engine") or {})
        for name, value in mapped.pop("engine", {}).items():
            if name in engine:
                raise ValueError(f"engine.{name}: set both in args and in llm_config")
            engine[name] = value
        both = sorted(set(mapped) & set(data))
        if both:
            raise ValueError(f"{both[0]}: set both in args and in llm_config")
        return {**data, **mapped, "engine": engine}

    @model_validator(mode="after")
    def _colocated_has_no_router(self) -> "AppArgs":
        if self.ingress == "colocated" and self.disaggregation is not None:
            raise ValueError("disaggregation: not with ingress: colocated (an Ingress calls both)")
        changed = self._separate_only_settings()
        if self.ingress == "colocated" and changed:
            raise ValueError(f"{', '.join(changed)}: not with ingress: colocated (no Ingress deployment)")
        return self

    def colocated(self) -> bool:
        """Whether each replica serves HTTP itself (`ingress`, with `auto` resolved)."""
        if self.models is not None or self.disaggregation is not None:
            return False  # the Ingress picks a model's deployment (or both of a model's)
        if self.ingress == "auto":
            return self.num_replicas == 1 and not self._separate_only_settings()
        return self.ingress == "colocated"

    @model_validator(mode="after")
    def _serve_target_where_serve_users_put_it(self) -> "AppArgs":
        """Serve's `autoscaling_config.target_ongoing_requests` is our policy's target too."""
        in_serve_config = (self.autoscaling_config or {}).get("target_ongoing_requests")
        if in_serve_config is None:
            return self
        if (
            "target_ongoing_requests" in self.model_fields_set
            and in_serve_config != self.target_ongoing_requests
        ):
            raise ValueError(
                "autoscaling_config.target_ongoing_requests and target_ongoing_requests differ: set one"
            )
        self.target_ongoing_requests = in_serve_config
        return self

    @model_validator(mode="after")
    def _each_model(self) -> "AppArgs":
        if self.models is not None:
            if self.ingress == "colocated":
                raise ValueError("ingress: colocated serves one model; with models, an Ingress picks one")
            names = [name for args in self.per_model() for name in args.served_names()]
            twice = sorted({name for name in names if names.count(name) > 1})
            if twice:
                raise ValueError(f"models: {twice[0]} is served twice (set served_model_name)")
        return self

    def per_model(self) -> list["AppArgs"]:
        """Each model's settings: this app's, or each entry of `models` over the settings set
        beside it (an entry's `engine` over theirs, key by key)."""
        if self.models is None:
            return [self]
        if not self.models:
            raise ValueError("models: list one model at least")
        shared = {name: getattr(self, name) for name in self.model_fields_set - APP_SETTINGS - {"llm_config"}}
        found = []
        for index, entry in enumerate(self.models):
            app_level = sorted(set(entry) & APP_SETTINGS)
            if app_level:
                raise ValueError(f"models[{index}].{app_level[0]}: an app setting; set it beside models")
            merged = {**shared, **entry}
            merged["engine"] = {**shared.get("engine", {}), **entry.get("engine", {})}
            try:
                found.append(AppArgs(**merged))
            except ValidationError as error:
                raise _located(error, f"models[{index}]") from None
        return found

    @model_validator(mode="after")
    def _roles_valid(self) -> "AppArgs":
        if self.disaggregation is not None and self.models is None:
            for name in ("prefill", "decode"):
                self.role(name)
        return self

    def role(self, name: str) -> "AppArgs":
        """The settings of the model's `prefill` or `decode` deployment: its role's over these."""
        assert self.disaggregation is not None
        entry = getattr(self.disaggregation, name)
        merged = self.model_dump(exclude_unset=True) | {"request_router": ROLE_ROUTERS[name]} | entry
        merged["engine"] = {**self.engine, **entry.get("engine", {})}
        merged.pop("disaggregation", None)
        merged.pop("llm_config", None)  # read into these settings already
        try:
            role = AppArgs(**merged)
        except ValidationError as error:
            raise _located(error, f"disaggregation.{name}") from None
        try:
            config = role.engine_config()
        except ValueError as error:
            raise ValueError(f"disaggregation.{name}: {error}") from None
        if config.num_workers > 1:
            raise ValueError(
                f"disaggregation.{name}.engine: tensor_parallel_size and pipeline_parallel_size must "
                "be 1 (parallel workers each hold part of a block; KV blocks do not move between them yet)"
            )
        if not config.enable_prefix_caching:
            raise ValueError(
                f"disaggregation.{name}.engine.enable_prefix_caching: must be true (moved KV blocks "
                "are found by their prefix-cache keys)"
            )
        return role

    def lora_settings(self) -> LoraSettings:
        return LoraSettings(
            tuple(self.lora_modules.items()),
            self.lora_root,
            self.engine.get("max_lora_rank", EngineConfig.max_lora_rank),
            self.allow_runtime_lora_updating,
        )

    def engine_config(self) -> EngineConfig:
        """Checked here, at build time, so a bad value fails `serve run` with the field's name."""
        engine = dict(self.engine)
        lora = self.lora_settings()
        if lora.enabled:
            if engine.get("enable_lora", True) is not True:
                raise ValueError(
                    "engine.enable_lora: false, but lora_modules, lora_root or "
                    "allow_runtime_lora_updating is set: LoRA adapters need it on"
                )
            engine["enable_lora"] = True
        config = EngineConfig(model=self.model, **engine)
        if lora.enabled:  # every listed adapter runs on this model (read_adapter, header only)
            check_lora_settings(lora, load_config(resolve_model(self.model)), self.served_name())
        if config.num_workers > 1:  # against the model's shape, read here too
            config.check_parallel(load_config(resolve_model(self.model)))
            if self.num_cpus <= 0:
                raise ValueError(
                    "num_cpus: a parallel replica reserves a placement-group bundle per worker, "
                    "and a bundle needs num_cpus > 0"
                )
        if self.placement_strategy != "STRICT_PACK" and config.distributed_executor_backend != "ray":
            raise ValueError(
                f"placement_strategy: {self.placement_strategy} may put workers on other nodes; "
                "worker processes (distributed_executor_backend: mp) stay on the replica's"
            )
        return config

    def served_name(self) -> str:
        """The model's name: what /v1/models lists and answers carry."""
        return self.served_names()[0]

    def served_names(self) -> list[str]:
        """Every name a request's `model` may give the model, its name first."""
        if isinstance(self.served_model_name, list):
            return self.served_model_name
        if self.served_model_name is not None:
            return [self.served_model_name]
        name = served_model_name(self.model)
        return [name, DEFAULT_MODEL_HUB_ID] if self.model == DEFAULT_MODEL else [name]
