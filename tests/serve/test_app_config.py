"""The shipped configs build, and bad args fail the deploy naming the field (no cluster needed)."""

from __future__ import annotations

import pydantic
import pytest
import yaml

from common.model_source import DEFAULT_MODEL, DEFAULT_MODEL_HUB_ID
from deployments.app import AppArgs, build_app, model_settings, replica_placement
from deployments.placement_fit import check_fits
from harness.serve_cluster import REPO


@pytest.mark.parametrize("config", ["serve_config.yaml", "serve_config.gpu.yaml"])
def test_shipped_configs_build(config: str):
    app_config = yaml.safe_load((REPO / config).read_text())["applications"][0]
    assert app_config["import_path"] == "deployments.app:build_app"
    build_app(AppArgs.model_validate(app_config["args"]))


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"engine": {"max_num_batched_tokns": 512}}, "max_num_batched_tokns"),
        ({"engine": {"max_num_seqs": 0}}, "max_num_seqs"),
        ({"sampling_defaults": {"temperature": -1}}, "temperature"),
        ({"num_gpu": 1}, "num_gpu"),
        ({"target_kv_cache_usage": 2}, "target_kv_cache_usage"),
        ({"request_router": "random"}, "request_router"),
    ],
)
def test_bad_args_name_the_field(args: dict, field: str):
    with pytest.raises((pydantic.ValidationError, ValueError), match=field):
        build_app(AppArgs.model_validate(args))


def test_a_tensor_parallel_replica_reserves_a_bundle_per_worker_on_one_node():
    args = AppArgs(model="dummy:tiny-llama", num_cpus=0.5, num_gpus=1, engine={"tensor_parallel_size": 2})
    assert replica_placement(args, args.engine_config()) == {
        # the replica's actor sees both GPUs: its workers are its child processes
        "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 2, "resources": {}},
        "placement_group_bundles": [{"CPU": 0.5, "GPU": 2}, {"CPU": 0.5}],
        "placement_group_strategy": "STRICT_PACK",
    }
    one = AppArgs(model="dummy:tiny-llama", num_cpus=0.5)
    assert "placement_group_bundles" not in replica_placement(one, one.engine_config())


def test_workers_as_ray_actors_get_bundles_of_their_own_placed_by_the_strategy():
    engine = {"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"}
    args = AppArgs(model="dummy:tiny-llama", num_gpus=1, placement_strategy="SPREAD", engine=engine)
    assert replica_placement(args, args.engine_config()) == {
        # the replica's actor needs no GPU: each worker's bundle holds its own
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 0, "resources": {}},
        "placement_group_bundles": [{"CPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}],
        "placement_group_strategy": "SPREAD",
    }


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"engine": {"tensor_parallel_size": 2}}, "tensor_parallel_size"),  # SmolLM2's 9 heads
        ({"model": "dummy:tiny-llama", "num_cpus": 0, "engine": {"tensor_parallel_size": 2}}, "num_cpus"),
        (  # worker processes cannot leave the replica's node
            {
                "model": "dummy:tiny-llama",
                "placement_strategy": "SPREAD",
                "engine": {"pipeline_parallel_size": 2},
            },
            "placement_strategy",
        ),
        ({"placement_strategy": "ANYWHERE"}, "placement_strategy"),
        ({"engine": {"distributed_executor_backend": "threads"}}, "distributed_executor_backend"),
        (
            {"engine": {"distributed_executor_backend": "ray", "core_process": True}},
            "distributed_executor_backend: ray needs core_process: false",
        ),
    ],
)
def test_bad_tensor_parallel_settings_fail_the_deploy(args: dict, field: str):
    with pytest.raises(ValueError, match=field):
        build_app(AppArgs.model_validate(args))


TWO_NODES = [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]


@pytest.mark.parametrize(
    ("bundles", "strategy", "fits"),
    [
        ([{"CPU": 1}, {"CPU": 1}], "STRICT_PACK", True),
        ([{"CPU": 1}, {"CPU": 1}, {"CPU": 1}], "STRICT_PACK", False),  # no node has 3 CPUs
        ([{"CPU": 1}, {"CPU": 1}, {"CPU": 1}], "PACK", True),  # two nodes have
        ([{"CPU": 1}, {"CPU": 1}, {"CPU": 1}], "STRICT_SPREAD", False),  # a node each: 2 nodes
        ([{"CPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}], "SPREAD", True),
        ([{"CPU": 0.5, "GPU": 1}] * 3, "SPREAD", False),  # 3 GPUs asked of 2
    ],
)
def test_a_placement_group_the_cluster_cannot_hold_fails_the_deploy_by_name(bundles, strategy, fits):
    if fits:
        check_fits(bundles, strategy, TWO_NODES, "tensor_parallel_size")
    else:
        with pytest.raises(ValueError, match=rf"tensor_parallel_size: .*placement_strategy {strategy}"):
            check_fits(bundles, strategy, TWO_NODES, "tensor_parallel_size")


def test_serves_target_ongoing_requests_is_read_where_serve_users_put_it():
    serve_style = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    args = AppArgs(num_replicas="auto", autoscaling_config=serve_style)
    engine_replicas = build_app(args)._bound_deployment.init_args[0][0][0]  # the first model's engine
    config = engine_replicas._bound_deployment._deployment_config.autoscaling_config
    assert config.policy.policy_kwargs["target_ongoing_requests"] == 8
    AppArgs(autoscaling_config=serve_style, target_ongoing_requests=8)  # the same value twice: fine
    with pytest.raises(ValueError, match=r"autoscaling_config\.target_ongoing_requests"):
        AppArgs(autoscaling_config=serve_style, target_ongoing_requests=2)


RAY_SERVE_LLM = {  # an LLMConfig as Ray Serve LLM's docs write one, our model in its place
    "model_loading_config": {"model_id": "my-llama", "model_source": "smollm2-135m-instruct"},
    "engine_kwargs": {
        "max_model_len": 2048,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 1 << 28,
        "enable_auto_tool_choice": True,
        "tool_call_parser": "hermes",
    },
    "deployment_config": {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8},
        "max_ongoing_requests": 64,
    },
    "accelerator_type": "H100",
    "lora_config": {"dynamic_lora_loading_path": "/adapters", "max_num_adapters_per_replica": 4},
    "log_engine_metrics": True,
}


def test_a_ray_serve_llm_config_is_read_into_ours():
    args = AppArgs(llm_config=RAY_SERVE_LLM)
    assert (args.served_model_name, args.model) == ("my-llama", "smollm2-135m-instruct")
    assert args.engine == {
        "max_model_len": 2048,
        "cuda_graphs": False,
        "kv_cache_bytes": 1 << 28,
        "max_cpu_loras": 4,
    }
    assert (args.num_replicas, args.max_ongoing_requests, args.target_ongoing_requests) == ("auto", 64, 8)
    assert args.autoscaling_config == RAY_SERVE_LLM["deployment_config"]["autoscaling_config"]
    assert (args.resources, args.num_gpus) == ({"accelerator_type:H100": 0.001}, 1)
    assert (args.tool_call_parser, args.lora_root) == ("hermes", "/adapters")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"engine_kwargs": {"kv_transfer_config": {}}},
            r"llm_config\.engine_kwargs\.kv_transfer_config: not",
        ),
        ({"runtime_env": {"pip": ["x"]}}, r"llm_config\.runtime_env: set it on the application"),
        (
            {"placement_group_config": {"bundles": [{"GPU": 1}]}},
            r"llm_config\.placement_group_config\.bundles",
        ),
        ({"deployment_config": {"graceful_shutdown_timeout_s": 5}}, "graceful_shutdown_timeout_s"),
        ({"llm_engine": "vLLM"}, r"llm_config\.llm_engine: not"),
    ],
)
def test_a_name_with_no_match_is_refused_by_name(change: dict, message: str):
    with pytest.raises(ValueError, match=message):
        AppArgs(llm_config={**RAY_SERVE_LLM, **change})


def test_a_setting_given_twice_is_refused():
    with pytest.raises(ValueError, match="max_ongoing_requests: set both in args and in llm_config"):
        AppArgs(llm_config=RAY_SERVE_LLM, max_ongoing_requests=8)
    with pytest.raises(ValueError, match=r"engine\.max_model_len: set both"):
        AppArgs(llm_config=RAY_SERVE_LLM, engine={"max_model_len": 512})


def test_several_models_each_take_the_shared_settings_under_their_own():
    args = AppArgs(
        engine={"dtype": "float32", "max_model_len": 512},
        sampling_defaults={"temperature": 0.2},
        api_key_env="KEYS",
        models=[
            {"served_model_name": "small"},
            {"served_model_name": "large", "num_replicas": 2, "engine": {"max_model_len": 1024}},
        ],
    )
    small, large = args.per_model()
    assert (small.served_name(), small.engine, small.num_replicas) == (
        "small",
        {"dtype": "float32", "max_model_len": 512},
        1,
    )
    assert (large.served_name(), large.engine, large.num_replicas) == (
        "large",
        {"dtype": "float32", "max_model_len": 1024},
        2,
    )
    assert small.sampling_defaults == large.sampling_defaults == {"temperature": 0.2}
    assert not args.colocated()  # one Ingress picks the model's deployment
    app = build_app(args)._bound_deployment
    names = [engine._bound_deployment.name for engine, _ in app.init_args[0]]
    assert names == ["EngineReplica-1", "EngineReplica-2"]
    assert [settings.model_name for _, settings in app.init_args[0]] == ["small", "large"]


@pytest.mark.parametrize(
    ("models", "named"),
    [
        ([{"served_model_name": "a", "api_key_file": "/k"}], r"models\[0\]\.api_key_file: an app setting"),
        ([{"served_model_name": "a"}, {"served_model_name": "a"}], "a is served twice"),
        ([{"served_model_name": "a"}, {"max_ongoing_requests": 0}], r"models\[1\].*max_ongoing_requests"),
        ([{"served_model_name": "a"}, {"served_model_name": "b", "bogus": 1}], r"models\[1\].*bogus"),
        ([], "list one model"),
    ],
)
def test_a_bad_model_entry_is_refused_naming_it(models: list, named: str):
    with pytest.raises(ValueError, match=named):
        AppArgs(models=models)


def test_several_models_cannot_be_colocated():
    with pytest.raises(ValueError, match="ingress: colocated"):
        AppArgs(ingress="colocated", models=[{"served_model_name": "a"}, {"served_model_name": "b"}])


def test_the_migration_pages_several_llm_configs_read_as_two_models():
    page = (REPO / "docs" / "migrating.md").read_text()
    block = next(b for b in page.split("```yaml")[1:] if "models:" in b).split("```")[0]
    args = AppArgs.model_validate(yaml.safe_load(block)["args"])
    models = args.per_model()
    assert [(m.served_name(), m.reasoning_parser) for m in models] == [
        ("llama-8b", None),
        ("qwen3-8b", "qwen3"),
    ]


def test_num_gpus_over_one_is_refused_saying_what_to_set():
    """Ray Serve LLM and vLLM users size a replica by its GPUs; ours is per worker."""
    with pytest.raises(ValueError, match=r"num_gpus\n.*set num_gpus: 1 and engine.tensor_parallel_size: 2"):
        AppArgs(num_gpus=2)
    assert AppArgs(num_gpus=0.5).num_gpus == 0.5  # a shared GPU


def test_disaggregation_builds_a_prefill_and_a_decode_deployment_each_with_its_own_settings():
    args = AppArgs(
        engine={"max_model_len": 2048},
        num_replicas="auto",
        disaggregation={
            "kv_connector": "tcp",
            "kv_ttl_s": 120,
            "prefill": {"num_replicas": 2, "engine": {"max_num_batched_tokens": 2048}},
            "decode": {
                "autoscaling_config": {"min_replicas": 1, "max_replicas": 6},
                "target_kv_cache_usage": 0.8,
            },
        },
    )
    assert not args.colocated()  # an Ingress calls both
    ((pair, settings),) = build_app(args)._bound_deployment.init_args[0]
    prefill, decode = pair.prefill._bound_deployment, pair.decode._bound_deployment
    assert (prefill.name, decode.name) == ("PrefillReplica", "DecodeReplica")
    assert (
        prefill._deployment_config.num_replicas == 2 and prefill.init_args[0].max_num_batched_tokens == 2048
    )
    assert prefill.init_args[3:] == decode.init_args[3:] == ("tcp", 120)  # the connector, its TTL
    scaling = decode._deployment_config.autoscaling_config
    assert scaling.max_replicas == 6 and scaling.policy.policy_kwargs["target_kv_cache_usage"] == 0.8
    routers = [d._deployment_config.request_router_config.request_router_class for d in (prefill, decode)]
    assert [str(cls).rsplit(".", 1)[-1].rsplit(":", 1)[-1] for cls in routers] == [
        "KVPrefixRouter",
        "KVPressureRouter",
    ]
    assert settings.max_model_len == 2048


@pytest.mark.parametrize(
    ("disaggregation", "named"),
    [
        ({"decode": {"model": "other"}}, "unknown settings for a role"),
        (
            {"prefill": {"engine": {"enable_prefix_caching": False}}},
            r"disaggregation\.prefill\.engine\.enable_prefix",
        ),
        (
            {"decode": {"engine": {"tensor_parallel_size": 3}}},
            r"disaggregation\.decode\.engine: tensor_parallel",
        ),
        (
            {"decode": {"engine": {"tensor_parallel_size": 2}}},
            r"disaggregation\.decode: tensor_parallel_size: 2",
        ),
        ({"prefill": {"num_replicas": "many"}}, r"disaggregation\.prefill\.num_replicas"),
        ({"kv_connector": "nixl"}, "kv_connector"),
    ],
)
def test_bad_disaggregation_settings_fail_the_deploy_by_name(disaggregation: dict, named: str):
    with pytest.raises(ValueError, match=named):
        AppArgs(disaggregation=disaggregation)


def test_served_model_names_and_the_embedded_defaults_hub_id():
    """One name or several (vLLM's --served-model-name a b: the first is the model's name); by
    default the embedded SmolLM2 also answers to its hub id, a set name replaces both."""
    default = model_settings(AppArgs(), AppArgs().engine_config())
    assert (default.model_name, default.aliases) == (DEFAULT_MODEL, (DEFAULT_MODEL_HUB_ID,))
    several = AppArgs(served_model_name=["mine", "theirs/model"])
    assert (several.served_name(), several.served_names()) == ("mine", ["mine", "theirs/model"])
    assert model_settings(several, several.engine_config()).aliases == ("theirs/model",)
    assert AppArgs(served_model_name="mine").served_names() == ["mine"]
    with pytest.raises(ValueError, match="served_model_name"):
        AppArgs(served_model_name=[])
    with pytest.raises(ValueError, match="served twice"):
        AppArgs(models=[{"served_model_name": ["a", "b"]}, {"served_model_name": "b"}])
