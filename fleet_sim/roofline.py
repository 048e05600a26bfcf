"""Step times for a GPU we cannot run here: a roofline of the accelerator's published peaks at
stated efficiencies, for a model's shape (its config.json fields), used by the simulator as the
step time itself (a StepTime, as the fitted StepTimeModel is).

A step runs its kernels one after another, so its time is a sum of rooflines, each max(bytes /
bandwidth, FLOPs / compute): the linear layers (every weight read once; 2 FLOPs per weight per
token), the decodes' attention (each key and value read once for one query), the prompt chunks'
attention (a matrix product: compute), the LM head for each sampled row, and a fixed overhead
per step (launches, the scheduler). Under tensor parallelism over N GPUs each does 1/N of every
term but the overhead, and two all-reduces per layer of the step's hidden states are added (a
ring's 2(N-1)/N of the bytes over the GPU interconnect, plus a fixed latency each). A mixture
of experts (models/moe.py) computes only each token's top-k experts, and reads only the experts
its step touches: with n tokens each picking k of E, E(1 - (1 - k/E)^n) distinct experts per layer
if routing were uniform (a trained router is skewed, touching fewer: so this is an upper bound
on the bytes), growing with the batch until every expert is read. Not modelled: a prompt
chunk's reads of its cached context, pipeline parallelism, quantized weights or KV. The engine's
linear StepTimeModel cannot stand for it: fitted to this roofline it is 30-50% off on both
sides of the knee where the linear layers turn from memory-bound to compute-bound, where decode
steps live.

    python -m fleet_sim.roofline --accelerator h100-sxm --model llama3-8b

prints its step times for typical shapes."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import AutoConfig

from common.kv_transfer import kv_block_bytes
from common.model_shapes import DUMMY_SHAPES, dummy_config_dict
from replica_engine.models.moe import MOE_MODEL_TYPES, MoeShape
from replica_engine.scheduler.step_time_model import ExpertRouting, StepShape

BYTES_PER_VALUE = 2  # bf16 weights and KV


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes_per_s: float  # peak HBM bandwidth
    flops_per_s: float  # dense bf16 peak
    memory_efficiency: float  # the fraction of each peak a serving engine's kernels reach (stated)
    compute_efficiency: float
    attention_efficiency: float
    step_overhead_s: float
    memory_bytes: float
    all_reduce_bytes_per_s: float  # what one GPU's link moves in an all-reduce (stated)
    all_reduce_latency_s: float

    def memory_s(self, num_bytes: float) -> float:
        return num_bytes / (self.memory_bytes_per_s * self.memory_efficiency)

    def compute_s(self, flops: float, efficiency: float) -> float:
        return flops / (self.flops_per_s * efficiency)


ACCELERATORS = {
    # NVIDIA's H100 SXM5 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16, 80 GB. Efficiencies:
    # ~80% of HBM bandwidth for large weight reads, ~60% of peak for GEMMs and ~50% for flash
    # attention in serving, ~1 ms of launches and scheduling per step: assumptions, not measured.
    # NVLink 4: 450 GB/s each way per GPU, ~70% of it in an all-reduce, ~10 us a collective:
    # assumptions too.
    "h100-sxm": Accelerator(
        "NVIDIA H100 SXM (80 GB)", 3.35e12, 989e12, 0.8, 0.6, 0.5, 1e-3, 80e9, 0.7 * 450e9, 10e-6
    ),
}


@dataclass(frozen=True)
class ModelCost:
    """What the weights, a token and an attention pair cost, from a model's config."""

    weight_bytes: float  # all of them, experts included
    linear_flops_per_token: float  # every layer's matmuls, without the LM head (experts: top-k)
    lm_head_flops: float  # per sampled row
    kv_bytes_per_token: float  # K and V of one token in every layer
    attention_flops_per_pair: float  # QK^T and PV, every head, every layer
    num_layers: int
    hidden_bytes_per_token: float  # one token's hidden state: what an all-reduce sums
    # Mixtures of experts: the experts of all sparse layers, and how many a token picks of how many
    expert_bytes_per_expert: float = 0.0  # one expert id's weights summed over the sparse layers
    num_experts: int = 0
    top_k: int = 0

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> ModelCost:
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        attention_weights = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
        mlp_weights = 3 * hidden * config["intermediate_size"]  # gate, up, down
        moe = MoeShape.of(AutoConfig.for_model(**config)) if config["model_type"] in MOE_MODEL_TYPES else None
        sparse = len(moe.sparse_layers) if moe else 0
        dense_weights = layers * attention_weights + (layers - sparse) * mlp_weights
        expert_weights, active_expert_weights = 0.0, 0.0
        if moe is not None:  # the router and a shared expert are read and computed as dense weights
            dense_weights += sparse * (hidden * moe.num_experts + 3 * hidden * moe.shared_width)
            expert_weights = sparse * moe.expert_bytes(hidden, 1)  # one expert id, every sparse layer
            active_expert_weights = moe.top_k * expert_weights
        embedding = config["vocab_size"] * hidden
        num_experts = moe.num_experts if moe else 0
        num_weights = (
            dense_weights
            + num_experts * expert_weights
            + embedding * (1 if config.get("tie_word_embeddings") else 2)
        )
        return cls(
            weight_bytes=num_weights * BYTES_PER_VALUE,
            linear_flops_per_token=2 * (dense_weights + active_expert_weights),
            lm_head_flops=2 * embedding,
            kv_bytes_per_token=kv_block_bytes(layers, 1, kv_heads, head_dim, BYTES_PER_VALUE),
            attention_flops_per_pair=4 * layers * heads * head_dim,
            num_layers=layers,
            hidden_bytes_per_token=hidden * BYTES_PER_VALUE,
            expert_bytes_per_expert=expert_weights * BYTES_PER_VALUE,
            num_experts=num_experts,
            top_k=moe.top_k if moe else 0,
        )

    def bytes_read(self, num_tokens: int) -> float:
        """The weights a step of `num_tokens` tokens reads: all but the experts its tokens do not
        pick (uniform routing: the expected count of distinct experts a layer's tokens pick)."""
        if not self.num_experts:
            return self.weight_bytes
        untouched = self.num_experts - ExpertRouting(self.num_experts, self.top_k).expected_touched(
            num_tokens
        )
        return self.weight_bytes - untouched * self.expert_bytes_per_expert


@dataclass(frozen=True)
class RooflineStepTime:
    """A StepTime: the roofline's time is both the expected time and the budget's."""

    accelerator: Accelerator
    cost: ModelCost
    tensor_parallel_size: int = 1  # GPUs per replica

    @classmethod
    def named(
        cls, accelerator: str, config: Mapping[str, Any], tensor_parallel_size: int = 1
    ) -> RooflineStepTime:
        if accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator: {accelerator!r} is not one of {sorted(ACCELERATORS)}")
        return cls(ACCELERATORS[accelerator], ModelCost.of(config), tensor_parallel_size)

    def predict_raw(self, shape: StepShape) -> float:
        a, cost, gpus = self.accelerator, self.cost, self.tensor_parallel_size
        tokens = shape.num_prefill_tokens + shape.num_decodes
        linear_flops = tokens * cost.linear_flops_per_token / gpus
        linear = max(
            a.memory_s(cost.bytes_read(tokens) / gpus), a.compute_s(linear_flops, a.compute_efficiency)
        )
        decode_pairs = shape.num_decode_attention_pairs / gpus  # each GPU its share of the heads
        decode_attention = max(
            a.memory_s(decode_pairs * cost.kv_bytes_per_token),
            a.compute_s(decode_pairs * cost.attention_flops_per_pair, a.attention_efficiency),
        )
        prompt_flops = shape.num_prompt_attention_pairs * cost.attention_flops_per_pair / gpus
        prompt_attention = a.compute_s(prompt_flops, a.attention_efficiency)
        lm_head = a.compute_s(shape.num_requests * cost.lm_head_flops / gpus, a.compute_efficiency)
        compute = linear + decode_attention + prompt_attention + lm_head
        return a.step_overhead_s + compute + self._all_reduces_s(tokens)

    def _all_reduces_s(self, tokens: int) -> float:
        """Two per layer (after attention's output projection and after the MLP), ring-style."""
        gpus = self.tensor_parallel_size
        if gpus == 1:
            return 0.0
        a, cost = self.accelerator, self.cost
        moved = 2 * (gpus - 1) / gpus * tokens * cost.hidden_bytes_per_token
        return 2 * cost.num_layers * (a.all_reduce_latency_s + moved / a.all_reduce_bytes_per_s)

    def predict(self, shape: StepShape) -> float:
        return self.predict_raw(shape)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--accelerator", default="h100-sxm", choices=sorted(ACCELERATORS))
    parser.add_argument("--model", default="llama3-8b", choices=DUMMY_SHAPES)
    args = parser.parse_args(argv)
    step_time = RooflineStepTime.named(args.accelerator, dummy_config_dict(args.model))
    print(f"{step_time.accelerator}\n{step_time.cost}")
    for context in (1024, 8192):
        for batch in (1, 16, 64, 256):
            shape = StepShape.of([(context, 1, True)] * batch)
            print(
                f"decode batch {batch:3} at context {context:5}: {step_time.predict_raw(shape) * 1e3:6.2f} ms"
            )
    for chunk in (512, 2048, 8192):
        shape = StepShape().plus(0, chunk)
        print(f"prompt chunk {chunk:5} from the start:   {step_time.predict_raw(shape) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
