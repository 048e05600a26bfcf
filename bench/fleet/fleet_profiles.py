"""The replicas bench.fleet.fleet simulates: this machine's CPU replica as serve_config.yaml ships it,
with the step time its engine learned in a bench.fleet.fleet_validation run, and Llama-3-8B on an H100
as vLLM would configure it, with a roofline's step time (fleet_sim/roofline.py)."""

from __future__ import annotations

from dataclasses import dataclass

from common.model_shapes import dummy_config_dict
from fleet_sim.replica import ReplicaConfig
from fleet_sim.roofline import RooflineStepTime
from replica_engine.kv_cache_manager import blocks_in_bytes
from replica_engine.scheduler.step_time_model import StepShape, StepTime, StepTimeModel

# The step time bench.fleet.fleet_validation's engine learned from its run (learned_from_run) on
# 2026-11-25T00:10, on an AVX-512 host running our CPU kernels in bf16: c0, c_prefill, c_decode,
# c_prompt_attention, c_decode_attention, c_request (s). Pinned: the workloads' rates are sized
# for it, and a later run on a host without AVX-512 (torch's fp32 ops, 2.2x slower prefill)
# overloaded every fleet, which compared routers in a regime the plan never meant to.
CPU_COEFFICIENTS = (
    0.01536931952345431,
    0.000637989600830799,
    0.0,
    3.5012986746988414e-07,
    4.5139559626836814e-07,
    0.0018284466278449699,
)
# serve_config.yaml's replica on this CPU: a 1 GiB KV pool of SmolLM2 is 2,911 blocks
CPU_REPLICA = ReplicaConfig(num_kv_blocks=2911, max_num_batched_tokens=256, max_num_seqs=64)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of the GPU's memory
ACTIVATION_RESERVE_BYTES = 2e9  # of it, what is not weights or KV (activations, CUDA graphs)
CONTEXT_TOKENS = 2048  # where decode capacity is compared


@dataclass(frozen=True)
class Profile:
    description: str
    replica: ReplicaConfig
    step_time: StepTime
    rate_scale: float  # workload rates over the CPU profile's: what a replica serves over a CPU one
    max_ongoing_requests: int  # Serve's backpressure: a full replica is skipped


def cpu_step_time() -> StepTimeModel:
    return StepTimeModel.from_coefficients(CPU_COEFFICIENTS)


def cpu_profile() -> Profile:
    description = "SmolLM2-135M on this CPU (bench.fleet.fleet_validation's learned step time, 2026-11-25)"
    return Profile(description, CPU_REPLICA, cpu_step_time(), 1.0, max_ongoing_requests=128)


def h100_llama3_8b_profile() -> Profile:
    """vLLM's H100 settings: 90% of 80 GB, 8,192-token steps; 256 sequences (vLLM V0's default);
    Ray Serve LLM's max_ongoing_requests (1e9: the engine queues). At serve_config.yaml's 128 a
    replica's running conversations fill it, and a full replica skipped for another costs the turn
    its cached history: on (c), kv_prefix's hit rate fell to 0.56 and its TTFT p90 to 15 s."""
    config = dummy_config_dict("llama3-8b")
    step_time = RooflineStepTime.named("h100-sxm", config)
    memory = step_time.accelerator.memory_bytes * GPU_MEMORY_UTILIZATION
    pool_bytes = int(memory - step_time.cost.weight_bytes - ACTIVATION_RESERVE_BYTES)
    block_bytes = int(step_time.cost.kv_bytes_per_token) * CPU_REPLICA.block_size
    replica = ReplicaConfig(
        num_kv_blocks=blocks_in_bytes(pool_bytes, block_bytes),
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        model="llama3-8b",
    )
    cpu = cpu_profile()
    scale = min(capacity(replica, step_time, decode) / capacity(cpu.replica, cpu.step_time, decode)
                for decode in (False, True))  # fmt: skip
    description = f"Llama-3-8B on an H100 SXM (roofline: {step_time.accelerator})"
    return Profile(description, replica, step_time, scale, max_ongoing_requests=10**9)


def capacity(replica: ReplicaConfig, step_time: StepTime, decode: bool) -> float:
    """Tokens/s of full steps: prompt chunks of the whole budget, or the most decodes at a
    2,048-token context."""
    if decode:
        shape = StepShape.of([(CONTEXT_TOKENS, 1, True)] * replica.max_num_seqs)
        return replica.max_num_seqs / step_time.predict_raw(shape)
    budget = replica.max_num_batched_tokens
    return budget / step_time.predict_raw(StepShape().plus(0, budget))


PROFILES = {"cpu": cpu_profile, "h100-llama3-8b": h100_llama3_8b_profile}
