"""A Ray Serve LLM `LLMConfig`, as its users write it, read into our app args (the `llm_config`
block of serve_config.yaml's `args`). Every name is mapped to ours or refused by name: a setting
that would be silently dropped is worse than a failed deploy. docs/migrating.md has the table."""

from __future__ import annotations

from typing import Any

# engine_kwargs (vLLM's engine args) that are ours too, under `engine`, with the same meaning
SAME_ENGINE_NAMES = frozenset(
    {
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "enable_prefix_caching",
        "dtype",
        "seed",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "enable_expert_parallel",
        "gpu_memory_utilization",
        "distributed_executor_backend",
        "enable_lora",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
        "async_scheduling",
        "speculative_config",
    }
)
SAME_APP_NAMES = frozenset({"served_model_name", "tool_call_parser", "reasoning_parser", "chat_template"})
DEPLOYMENT_NAMES = frozenset({"num_replicas", "max_ongoing_requests", "max_queued_requests"})
TOP_NAMES = frozenset(
    {
        "model_loading_config",
        "engine_kwargs",
        "deployment_config",
        "accelerator_type",
        "placement_group_config",
        "lora_config",
        "runtime_env",
        "log_engine_metrics",
    }
)
ACCELERATOR_SHARE = 0.001  # of the `accelerator_type:X` resource Ray gives a node with that GPU


class _Args:
    """Our args as the block sets them; a name set twice is an error naming both places."""

    def __init__(self) -> None:
        self.args: dict[str, Any] = {}
        self.where: dict[str, str] = {}

    def set(self, name: str, value: Any, source: str) -> None:
        if name in self.args:
            raise ValueError(f"llm_config.{source} and llm_config.{self.where[name]}: both set {name}")
        self.args[name] = value
        self.where[name] = source

    def engine(self, name: str, value: Any, source: str) -> None:
        self.args.setdefault("engine", {})
        if name in self.args["engine"]:
            raise ValueError(f"llm_config.{source}: engine.{name} set twice")
        self.args["engine"][name] = value


def _refuse_unknown(block: dict[str, Any], known: frozenset[str], where: str, why: str = "") -> None:
    unknown = sorted(set(block) - known)
    if unknown:
        raise ValueError(
            f"llm_config.{where}{unknown[0]}: not a setting stallfree has{why} (docs/migrating.md)"
        )


def args_from_llm_config(block: dict[str, Any]) -> dict[str, Any]:
    """Our args (`engine` among them) from an LLMConfig's fields."""
    if not isinstance(block, dict):
        raise ValueError("llm_config: must be a mapping of LLMConfig's fields")
    _refuse_unknown(block, TOP_NAMES, "")
    if "runtime_env" in block:
        raise ValueError(
            "llm_config.runtime_env: set it on the application in serve_config.yaml (Serve's own)"
        )
    out = _Args()
    loading = block.get("model_loading_config") or {}
    _refuse_unknown(loading, frozenset({"model_id", "model_source"}), "model_loading_config.")
    if "model_source" in loading:
        out.set("model", loading["model_source"], "model_loading_config.model_source")
    if "model_id" in loading:
        out.set("served_model_name", loading["model_id"], "model_loading_config.model_id")
    _engine_kwargs(block.get("engine_kwargs") or {}, out)
    _deployment(block.get("deployment_config") or {}, out)
    if "accelerator_type" in block:  # a GPU per engine worker, on nodes with that type
        out.set(
            "resources",
            {f"accelerator_type:{block['accelerator_type']}": ACCELERATOR_SHARE},
            "accelerator_type",
        )
        out.set("num_gpus", 1, "accelerator_type")
    placement = block.get("placement_group_config") or {}
    _refuse_unknown(
        placement, frozenset({"strategy"}), "placement_group_config.", ": bundles follow from "
        "tensor_parallel_size x pipeline_parallel_size, num_gpus and num_cpus"
    )  # fmt: skip
    if "strategy" in placement:
        out.set("placement_strategy", placement["strategy"], "placement_group_config.strategy")
    lora = block.get("lora_config") or {}
    _refuse_unknown(
        lora, frozenset({"dynamic_lora_loading_path", "max_num_adapters_per_replica"}), "lora_config."
    )
    if "dynamic_lora_loading_path" in lora:
        out.set("lora_root", lora["dynamic_lora_loading_path"], "lora_config.dynamic_lora_loading_path")
    if "max_num_adapters_per_replica" in lora:
        out.engine(
            "max_cpu_loras", lora["max_num_adapters_per_replica"], "lora_config.max_num_adapters_per_replica"
        )
    # log_engine_metrics: our engines always export their metrics
    return out.args


def _engine_kwargs(kwargs: dict[str, Any], out: _Args) -> None:
    known = (
        SAME_ENGINE_NAMES
        | SAME_APP_NAMES
        | {"kv_cache_memory_bytes", "enforce_eager", "enable_auto_tool_choice"}
    )
    _refuse_unknown(kwargs, frozenset(known), "engine_kwargs.")
    for name, value in kwargs.items():
        source = f"engine_kwargs.{name}"
        if name in SAME_ENGINE_NAMES:
            out.engine(name, value, source)
        elif name in SAME_APP_NAMES:
            out.set(name, value, source)
        elif name == "kv_cache_memory_bytes":
            out.engine("kv_cache_bytes", value, source)
        elif name == "enforce_eager":
            out.engine("cuda_graphs", not value, source)
        elif value is not True:  # enable_auto_tool_choice: tool calls are on wherever a parser is
            raise ValueError(f"llm_config.{source}: only true (set tool_call_parser: null for no tool calls)")


def _deployment(config: dict[str, Any], out: _Args) -> None:
    _refuse_unknown(config, DEPLOYMENT_NAMES | {"autoscaling_config"}, "deployment_config.")
    for name in DEPLOYMENT_NAMES & set(config):
        out.set(name, config[name], f"deployment_config.{name}")
    if "autoscaling_config" in config:
        out.set("num_replicas", "auto", "deployment_config.autoscaling_config")
        out.set("autoscaling_config", config["autoscaling_config"], "deployment_config.autoscaling_config")
