"""Sizing a fleet from a user's own trace and serve_config.yaml: `python -m fleet_sim.sizing`.

A trace is JSON Lines, one request per line, in any order:
    {"arrival_s": 0.5, "output_tokens": 120, "prompt_token_ids": [1, 2, ...]}
    {"arrival_s": 0.7, "output_tokens": 80, "prompt_tokens": 2100, "prefix_id": "t3", "prefix_tokens": 2000}
`prompt_token_ids` are exact; `prompt_tokens` alone is that many tokens shared with no other
request; with `prefix_id` the first `prefix_tokens` of them are the same for every request naming
that prefix (a tenant's system prompt, a document). `tenant` (optional) labels a request. A
malformed line, or a serve_config setting the simulator cannot model, is an error naming the
line or the field; nothing is silently defaulted.

Prints, per replica count and router, TTFT p50/p90, TBT p99, output tok/s and the prefix-cache hit
rate, and the fewest replicas that meet a TTFT p90 target per router."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import yaml

from common.kv_transfer import kv_block_bytes
from fleet_sim.fleet import Fleet, FleetConfig
from fleet_sim.records import summarize_records
from fleet_sim.replica import ReplicaConfig
from fleet_sim.roofline import ACCELERATORS, RooflineStepTime
from fleet_sim.routers import ROUTERS, make_router
from fleet_sim.trace import VOCAB_SIZE, SimRequest, output_token
from replica_engine.kv_cache_manager import blocks_in_bytes
from replica_engine.scheduler.step_time_model import StepTime, StepTimeModel

# serve_config.yaml's engine settings the simulator models (ReplicaConfig's fields), and the ones
# that change nothing it simulates.
REPLICA_FIELDS = ("max_num_batched_tokens", "max_num_seqs", "block_size", "scheduling_policy",
                  "enable_prefix_caching", "tbt_slo_s", "pipeline_parallel_size")  # fmt: skip
ENGINE_MODELED = {*REPLICA_FIELDS, "num_kv_blocks", "kv_cache_bytes", "dtype", "tensor_parallel_size"}
# Where the workers run changes nothing the simulator models (their transfers are not modeled).
# quantization changes step times alone, which the step-time model carries (a fit of a run made
# with it; the roofline is a GPU's, where weights are float); the KV pool is the same.
ENGINE_IGNORED = {
    "attention_backend",
    "seed",
    "max_model_len",
    "device",
    "distributed_executor_backend",
    "quantization",
    "disable_any_whitespace",  # structured outputs: what is generated, not how fast
    # the roofline gives each of N GPUs 1/N of the experts' bytes and FLOPs, split by width or not
    "enable_expert_parallel",
}
# ingress_replicas: one is the simulator's one router; more are refused. ingress: separate is
# that router in front of the replicas (and auto is separate for a sized fleet of several);
# colocated replicas have none and are refused.
APP_MODELED = {
    "model",
    "num_replicas",
    "request_router",
    "max_ongoing_requests",
    "engine",
    "ingress_replicas",
    "ingress",
    "llm_config",  # refused: the simulator reads our names (docs/migrating.md maps them)
    "models",  # refused: a fleet of one model is sized at a time
    "disaggregation",  # refused: P/D fleets are compared by bench.fleet.disaggregation
}
APP_IGNORED = {"served_model_name", "num_gpus", "num_cpus", "resources", "cpu_threads", "max_queued_requests",
               "placement_strategy",
               "sampling_defaults", "generation_config", "reasoning_parser",
               "ingress_max_ongoing_requests", "request_timeout_s", "api_key_env",
               "api_key_file", "max_request_body_bytes", "chat_template", "tool_call_parser",
               # LoRA: a trace names each request's adapter; no adapter file is read
               "lora_modules", "lora_root", "allow_runtime_lora_updating",
               # autoscaling's: only read with num_replicas "auto", which is refused
               "autoscaling_config", "target_kv_cache_usage", "target_waiting_requests",
               "target_ongoing_requests", "target_utilization", "backlog_drain_s"}  # fmt: skip
DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "auto": 2,
}  # auto: bf16 on GPUs and AVX512-BF16 CPUs


def load_trace(path: Path) -> list[SimRequest]:
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error.msg})") from None
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: must be a JSON object")
        requests.append(_request(entry, f"line-{number}", where))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return sorted(requests, key=lambda request: request.arrival_s)


TRACE_FIELDS = {
    "arrival_s",
    "output_tokens",
    "prompt_token_ids",
    "prompt_tokens",
    "prefix_id",
    "prefix_tokens",
    "tenant",
}


def _request(entry: dict[str, Any], request_id: str, where: str) -> SimRequest:
    known = TRACE_FIELDS
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (fields: {sorted(known)})")
    arrival = _number(entry, "arrival_s", where, minimum=0.0)
    output_tokens = _integer(entry, "output_tokens", where, minimum=1)
    tenant = entry.get("tenant", "")
    if not isinstance(tenant, str):
        raise ValueError(f"{where}: field 'tenant' must be a string")
    if "prompt_token_ids" in entry:
        ids = entry["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(f"{where}: field 'prompt_token_ids' must be a non-empty list of token ids")
        return SimRequest(request_id, arrival, tuple(ids), output_tokens, tenant)
    num_tokens = _integer(entry, "prompt_tokens", where, minimum=1)
    prompt: tuple[int, ...] = ()
    prefix_id = entry.get("prefix_id")
    if prefix_id is not None:
        length = _integer(entry, "prefix_tokens", where, minimum=1)
        if length > num_tokens:
            raise ValueError(
                f"{where}: field 'prefix_tokens' ({length}) exceeds 'prompt_tokens' ({num_tokens})"
            )
        prompt = tuple(
            output_token(f"prefix:{prefix_id}", i) for i in range(length)
        )  # the same wherever named
    rng = random.Random(request_id)
    prompt += tuple(rng.randrange(VOCAB_SIZE) for _ in range(num_tokens - len(prompt)))
    return SimRequest(request_id, arrival, prompt, output_tokens, tenant or str(prefix_id or ""))


def _number(entry: dict[str, Any], name: str, where: str, minimum: float) -> float:
    value = entry.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ValueError(f"{where}: field {name!r} must be a number >= {minimum}, got {value!r}")
    return float(value)


def _integer(entry: dict[str, Any], name: str, where: str, minimum: int) -> int:
    value = entry.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def fleet_settings(path: Path) -> tuple[ReplicaConfig, int, str]:
    """From serve_config.yaml's first application: a replica's engine settings, its
    max_ongoing_requests and the router. A setting the simulator cannot model is an error."""
    config = yaml.safe_load(path.read_text())
    try:
        args = config["applications"][0].get("args") or {}
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ValueError(f"{path}: no applications[0]") from None
    unknown = sorted(set(args) - APP_MODELED - APP_IGNORED)
    if unknown:
        raise ValueError(f"{path}: args.{unknown[0]} is not a setting the simulator models")
    if args.get("num_replicas", 1) == "auto":
        raise ValueError(
            f"{path}: args.num_replicas 'auto': size with --replicas (autoscaling is not simulated here)"
        )
    if args.get("ingress_replicas", 1) != 1:
        raise ValueError(
            f"{path}: args.ingress_replicas {args['ingress_replicas']}: the simulator routes with one "
            "router (several learn each other's choices only from the replicas' reports)"
        )
    if args.get("llm_config") is not None:
        raise ValueError(
            f"{path}: args.llm_config: write its settings as ours to size a fleet (docs/migrating.md)"
        )
    if args.get("disaggregation") is not None:
        raise ValueError(
            f"{path}: args.disaggregation: this sizes colocated fleets; `python -m bench "
            "disaggregation_map` simulates prefill/decode fleets"
        )
    if args.get("models") is not None:
        raise ValueError(
            f"{path}: args.models: size one model's fleet at a time (its entry's settings as the args)"
        )
    if args.get("ingress", "auto") == "colocated":
        raise ValueError(
            f"{path}: args.ingress {args['ingress']}: the simulator routes with a request router, "
            "and colocated replicas have none (Serve's proxy or HAProxy balances them)"
        )
    engine = args.get("engine") or {}
    unknown = sorted(set(engine) - ENGINE_MODELED - ENGINE_IGNORED)
    if unknown:
        raise ValueError(f"{path}: args.engine.{unknown[0]} is not a setting the simulator models")
    model = args.get("model", "smollm2-135m-instruct")
    settings = {name: engine[name] for name in REPLICA_FIELDS if name in engine}
    block_size = settings.get("block_size", 16)
    replica = ReplicaConfig(
        num_kv_blocks=_num_kv_blocks(path, engine, model, block_size), model=model, **settings
    )
    return replica, int(args.get("max_ongoing_requests", 128)), str(args.get("request_router", "kv_prefix"))


def _num_kv_blocks(path: Path, engine: dict[str, Any], model: str, block_size: int) -> int:
    """num_kv_blocks, or what kv_cache_bytes holds for this model's K/V (as the engine sizes it)."""
    if "num_kv_blocks" in engine:
        return int(engine["num_kv_blocks"])
    if "kv_cache_bytes" not in engine:
        raise ValueError(
            f"{path}: args.engine needs kv_cache_bytes or num_kv_blocks (a GPU's pool depends on the GPU)"
        )
    dtype = engine.get("dtype", "auto")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{path}: args.engine.dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    shape = model_config(model)
    heads = shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or shape["hidden_size"] // heads
    kv_heads = shape.get("num_key_value_heads") or heads
    block_bytes = kv_block_bytes(
        shape["num_hidden_layers"], block_size, kv_heads, head_dim, DTYPE_BYTES[dtype]
    )
    return blocks_in_bytes(int(engine["kv_cache_bytes"]), block_bytes)


def tensor_parallel_size(path: Path) -> int:
    """GPUs per replica (the roofline's; the KV blocks come from kv_cache_bytes, the replica's)."""
    args = yaml.safe_load(path.read_text())["applications"][0].get("args") or {}
    return int((args.get("engine") or {}).get("tensor_parallel_size", 1))


def model_config(model: str) -> dict[str, Any]:
    """The model's config.json fields (its shape)."""
    from common.model_source import model_config_dict, resolve_model

    return model_config_dict(resolve_model(model))


def load_step_time(path: Path) -> StepTimeModel:
    """A JSON file with `coefficients` (six seconds: per step, prompt token, decode, query-key
    pair of a prompt chunk, of a decode, request), or bench.fleet.fleet_validation's result (its
    `learned_from_run`)."""
    coefficients = json.loads(path.read_text()).get("coefficients")
    if isinstance(coefficients, dict):
        coefficients = coefficients.get("learned_from_run")
    if not isinstance(coefficients, list):
        raise ValueError(f"{path}: no 'coefficients' list (or 'coefficients.learned_from_run')")
    return StepTimeModel.from_coefficients(coefficients)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--serve-config", type=Path, default=Path("serve_config.yaml"))
    parser.add_argument(
        "--step-time",
        type=Path,
        default=Path("bench/results/fleet_validation.json"),
        help="step-time coefficients (default: this CPU's, from bench.fleet.fleet_validation)",
    )
    parser.add_argument(
        "--accelerator",
        choices=sorted(ACCELERATORS),
        help="instead of --step-time: this GPU's roofline for the config's model (fleet_sim/roofline.py)",
    )
    parser.add_argument("--replicas", default="1,2,4,8", help="replica counts to try")
    parser.add_argument(
        "--routers", default=None, help=f"of {sorted(ROUTERS)} (default: the config's and power_of_two)"
    )
    parser.add_argument("--ttft-p90-target", type=float, default=2.0, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        requests = load_trace(args.trace)
        replica, max_ongoing, configured = fleet_settings(args.serve_config)
        gpus = tensor_parallel_size(args.serve_config)
        if gpus > 1 and not args.accelerator:
            raise ValueError(
                "engine.tensor_parallel_size: needs --accelerator (a fitted step time is one worker's)"
            )
        step_time: StepTime = (
            RooflineStepTime.named(args.accelerator, model_config(replica.model), gpus)
            if args.accelerator
            else load_step_time(args.step_time)
        )
        routers = (
            args.routers.split(",") if args.routers else list(dict.fromkeys([configured, "power_of_two"]))
        )
        counts = [int(n) for n in args.replicas.split(",")]
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    print(
        f"{len(requests)} requests; a replica: {replica.num_kv_blocks} KV blocks, "
        f"max_ongoing_requests {max_ongoing}" + (f", {gpus} GPUs (tensor parallel)" if gpus > 1 else "")
    )
    needed: dict[str, int | None] = dict.fromkeys(routers)
    for count in counts:
        for router in routers:
            fleet = Fleet(FleetConfig(count, replica, max_ongoing), step_time, make_router(router, args.seed))
            summary = summarize_records(fleet.run(requests))
            print(
                f"{count:4} replicas {router:22} TTFT p50 {summary['ttft_p50_s']:7.2f} s"
                f"  p90 {summary['ttft_p90_s']:7.2f} s  TBT p99 {summary.get('tbt_p99_s', 0):6.3f} s"
                f"  {summary['output_tok_per_s']:8.1f} tok/s  hit {summary['hit_rate']:.2f}"
            )
            if needed[router] is None and summary["ttft_p90_s"] <= args.ttft_p90_target:
                needed[router] = count
    for router, count in needed.items():
        verdict = f"{count} replicas" if count else f"more than {max(counts)} replicas"
        print(f"TTFT p90 <= {args.ttft_p90_target} s with {router}: {verdict}")


if __name__ == "__main__":
    main()
