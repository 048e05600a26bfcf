"""`build_app`: the Serve application (Ingress -> EngineReplica x N per model) from typed args.

serve_config.yaml names `deployments.app:build_app` and puts these args under `args:`; Serve
validates them into AppArgs because the builder's parameter is a pydantic model."""

import os
from typing import Any

import ray
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from deployments.app_args import AppArgs, Disaggregation
from deployments.disaggregated_engine import PrefillDecode
from deployments.engine_replica import EngineReplica
from deployments.in_process_engine import ColocatedReplica
from deployments.ingress import Ingress, IngressSettings
from deployments.placement_fit import check_fits, cluster_nodes
from deployments.served_model import ModelSettings
from replica_engine import EngineConfig
from router.autoscaling import KVPressurePolicy
from router.kv_router import KVPressureRouter
from router.prefix_router import KVPrefixRouter
from router.round_robin import RoundRobinRouter
from router.same_node import SameNodeRouter


def _autoscaling(args: AppArgs) -> dict[str, Any]:
    if args.num_replicas != "auto":
        return {"num_replicas": args.num_replicas}
    policy = AutoscalingPolicy(
        policy_function=KVPressurePolicy,
        policy_kwargs={
            "target_kv_cache_usage": args.target_kv_cache_usage,
            "target_waiting_requests": args.target_waiting_requests,
            "target_ongoing_requests": args.target_ongoing_requests,
            "target_utilization": args.target_utilization,
            "backlog_drain_s": args.backlog_drain_s,
        },
    )
    return {"autoscaling_config": AutoscalingConfig(**(args.autoscaling_config or {}), policy=policy)}


# prefix_cache_affinity is Ray Serve LLM's router: `ray.serve.llm.request_router`'s public
# PrefixCacheAffinityRouter subclasses the class imported here without change; we import it where
# it is defined because the public module also loads Ray's vLLM/SGLang glue, which needs an engine
# we do not install.
ROUTERS = {
    "kv_prefix": KVPrefixRouter,
    "kv_pressure": KVPressureRouter,
    "round_robin": RoundRobinRouter,
    "prefix_cache_affinity": PrefixCacheAffinityRouter,
}


def _routing(args: AppArgs) -> dict[str, Any]:
    if args.request_router == "power_of_two":
        return {}
    # Attached as a class, not an import string: Serve's controller cannot import from a working_dir.
    router_class = ROUTERS[args.request_router]
    config = RequestRouterConfig(request_router_class=router_class, request_routing_stats_period_s=0.5)
    return {"request_router_config": config}


# The Ingress calls its replicas over Serve's gRPC (replica_calls.by_value), which refuses a message
# over 4 MiB by default: a request of many long prompts, or an answer of many embeddings, is larger.
# Both ends read the limit from their process's environment.
GRPC_MESSAGE_LIMIT_ENV = {"env_vars": {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str((1 << 31) - 1)}}


def _ingress_routing() -> dict[str, Any]:
    """A request stays on its node's Ingress (router/same_node.py says why). Under Serve's HAProxy
    ingress HTTP goes straight to an Ingress replica's own server, and Serve refuses a router there."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        return {}
    return {"request_router_config": RequestRouterConfig(request_router_class=SameNodeRouter)}


def replica_placement(args: AppArgs, config: EngineConfig) -> dict[str, Any]:
    """The replica's resources. A parallel replica gets a placement group. Its workers as child
    processes (`mp`) sit on its node: STRICT_PACK, one bundle per worker, the first (the replica's
    actor) holding every worker's GPUs so that all of them are visible to it (worker r uses the
    r-th). As Ray actors (`ray`): the replica's bundle, then one per worker with its own GPUs,
    placed by `placement_strategy`."""
    workers = config.num_workers
    options = {"num_cpus": args.num_cpus, "num_gpus": args.num_gpus * workers, "resources": args.resources}
    if workers == 1:
        return {"ray_actor_options": options}
    worker_gpus = {"GPU": args.num_gpus} if args.num_gpus else {}
    if config.distributed_executor_backend == "ray":
        options["num_gpus"] = 0
        bundles = [{"CPU": args.num_cpus, **args.resources}] + [
            {"CPU": args.num_cpus, **worker_gpus}
        ] * workers
    else:
        gpus = {"GPU": args.num_gpus * workers} if args.num_gpus else {}
        bundles = [{"CPU": args.num_cpus, **gpus, **args.resources}] + [{"CPU": args.num_cpus}] * (
            workers - 1
        )
    return {
        "ray_actor_options": options,
        "placement_group_bundles": bundles,
        "placement_group_strategy": args.placement_strategy,
    }


def model_settings(args: AppArgs, config: EngineConfig) -> ModelSettings:
    """What the Ingress needs of one model's settings."""
    return ModelSettings(
        args.model,
        args.served_name(),
        config.max_model_len,
        args.sampling_defaults,
        args.chat_template,
        args.tool_call_parser,
        args.lora_settings(),
        args.reasoning_parser,
        args.generation_config == "auto",
        tuple(args.served_names()[1:]),
    )


def _replica_options(args: AppArgs, config: EngineConfig) -> dict[str, Any]:
    """One model's engine replicas: their resources, limits and scaling."""
    placement = replica_placement(args, config)
    if "placement_group_bundles" in placement and ray.is_initialized():  # where Serve builds the app
        check_fits(
            placement["placement_group_bundles"],
            args.placement_strategy,
            cluster_nodes(),
            "engine.tensor_parallel_size x pipeline_parallel_size (a bundle each, of num_cpus and num_gpus)",
        )
    actor_options = {**placement["ray_actor_options"], "runtime_env": GRPC_MESSAGE_LIMIT_ENV}
    return {
        **placement,
        "ray_actor_options": actor_options,
        "max_ongoing_requests": args.max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        **_autoscaling(args),
    }


def _engine_replicas(args: AppArgs, name: str, disaggregation: Disaggregation | None = None) -> Application:
    """A deployment of EngineReplica for one model (or one role of it)."""
    config = args.engine_config()
    replica = EngineReplica.options(name=name, **_replica_options(args, config), **_routing(args))
    if disaggregation is None:
        return replica.bind(config, args.served_name(), args.cpu_threads)
    connector = (disaggregation.kv_connector, disaggregation.kv_ttl_s)
    return replica.bind(config, args.served_name(), args.cpu_threads, *connector)


def build_app(args: AppArgs) -> Application:
    settings = IngressSettings(
        args.api_key_env, args.api_key_file, args.max_request_body_bytes, args.request_timeout_s
    )
    if args.colocated():  # the Ingress's replicas are the engine replicas
        config = args.engine_config()
        colocated = ColocatedReplica(config, args.served_name(), args.cpu_threads)
        ingress = Ingress.options(**_replica_options(args, config), **_ingress_routing())
        return ingress.bind([(colocated, model_settings(args, config))], settings)
    several = args.models is not None
    engines: list[tuple[Any, ModelSettings]] = []
    for index, model in enumerate(args.per_model(), 1):
        suffix = f"-{index}" if several else ""
        config = model.engine_config()
        if model.disaggregation is None:
            engines.append((_engine_replicas(model, f"EngineReplica{suffix}"), model_settings(model, config)))
            continue
        prefill, decode = (
            _engine_replicas(model.role(role), f"{role.title()}Replica{suffix}", model.disaggregation)
            for role in ("prefill", "decode")
        )
        pair = PrefillDecode(prefill, decode, model.disaggregation.prefill_timeout_s)
        engines.append((pair, model_settings(model, config)))
    ingress = Ingress.options(
        max_ongoing_requests=args.ingress_max_ongoing_requests,
        num_replicas=args.ingress_replicas,
        max_replicas_per_node=1 if args.ingress_replicas > 1 else None,
        ray_actor_options={"num_cpus": 0, "runtime_env": GRPC_MESSAGE_LIMIT_ENV},
        **_ingress_routing(),
    )
    return ingress.bind(engines, settings)
