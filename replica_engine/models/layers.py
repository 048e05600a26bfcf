"""The layers every model of ours is built of, on [T, hidden] rows (all scheduled tokens of all
requests): RMSNorm with the residual add fused, linear layers through the CPU kernels (merged
projections of one input, row-parallel ones summed over workers, LoRA deltas), the gated MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from replica_engine.kernels import cpu as cpu_kernels
from replica_engine.kernels import pointwise
from replica_engine.kernels.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from replica_engine.lora.linear import LoRALinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim]: Qwen3's per-head q/k norms ([T, heads, head_dim]) run as rows too, through
        the kernels (torch's ops took ~50 us a call on a CPU)."""
        rows = x.reshape(-1, x.shape[-1])  # a copy where x is a view of the fused q/k/v
        return pointwise.rms_norm(rows, self.weight, self.eps)[0].view(x.shape)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the residual stream starts as x (residual None)."""
        return pointwise.rms_norm(x, self.weight, self.eps, residual)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """None: the loader loads or fills the table."""


class Linear(nn.Linear):
    """nn.Linear, through a CPU kernel once its weight is held in that kernel's layout: packed
    by `pack_for_cpu`, or quantized (`hold`). Row-parallel under tensor parallelism
    (`sum_across_workers`): each worker holds a slice of the input features, and the partial
    products are summed over the workers before the bias. With LoRA, each token's adapter
    delta is added to the product (replica_engine/lora)."""

    packed: cpu_kernels.PackedWeight | QuantizedWeight | cpu_kernels.TiledWeight | None = None
    sum_across_workers = False
    lora: LoRALinear | None = None

    def reset_parameters(self) -> None:
        """None: the loader loads or fills every weight (nn.Linear's random init took half of
        building a Qwen3-0.6B-shaped model on a CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_kernels.linear(x, self.packed or self.weight)
        if self.lora is not None:
            self.lora.add_delta(x, out)
        if self.sum_across_workers:
            dist.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def hold(self, weight: QuantizedWeight) -> None:
        """Serve from a quantized weight; the float one is freed."""
        assert (weight.out_features, weight.in_features) == (self.out_features, self.in_features)
        self.packed, self.weight = weight, None

    def pack_for_cpu(self, amx_weights: bool = False) -> None:
        """Repack the weight for the CPU kernel where it applies (a quantized weight is already
        in its kernel's layout); the packed copy replaces it. `amx_weights`: with a bfloat16 copy
        beside it for steps of many tokens (EngineConfig.amx_weights)."""
        if self.packed is None:
            self.packed = cpu_kernels.pack_weight(self.weight)
        if self.packed is None:
            return
        if amx_weights and not isinstance(self.packed, cpu_kernels.TiledWeight):
            self.packed = cpu_kernels.tiled_weight(self.packed, self.weight)
        self.weight = None


class MergedLinear(Linear):
    """Several projections of one input stacked into one matmul (q/k/v, gate/up)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        start = sum(self.shard_sizes[:shard_id])
        return start, start + self.shard_sizes[shard_id]


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(pointwise.silu_mul(self.gate_up_proj(x)))
