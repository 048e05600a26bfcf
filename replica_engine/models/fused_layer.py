"""A dense decoder layer in one call on a CPU (kernels/cpu_decoder_layer.cpp): the kernels that
DecoderLayer.forward calls one by one, in the same order on the same rows, so a token's numbers
are the same either way. At a decode step's few rows the layer's Python around its kernels cost
about as much as its matmuls over the 4-bit model; here it is one call a layer.

It stands in only where the layer is plain: the CPU's paged attention backend, every projection
on a kernel weight (packed or quantized, no AMX copy), no bias, q/k norm, experts or tensor
parallelism, no LoRA adapter's rows in the step (checked at each call: with LoRA on, a step of
base-model rows alone adds no delta, so it runs here too), and a step whose prompt rows, if any,
follow its generated ones (prompt_rows.py). Anything else runs the module."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from replica_engine.attention.base import AttentionMetadata
from replica_engine.attention.cpu_paged import CPUPagedAttention
from replica_engine.kernels import cpu as cpu_kernels
from replica_engine.kernels.quantized_weight import QuantizedWeight
from replica_engine.models.layers import MLP, Linear

if TYPE_CHECKING:
    from replica_engine.models.llama import DecoderLayer

LayerLinear = tuple[torch.Tensor, torch.Tensor | None, int, int, int]


def _kernel_weight(linear: Linear) -> LayerLinear | None:
    """The C++ side's view of a projection's weight; None where it is not a plain kernel weight."""
    if linear.bias is not None or linear.sum_across_workers or linear.lora is not None:
        return None
    weight = linear.packed
    if isinstance(weight, QuantizedWeight):
        return (weight.codes, weight.scales, weight.out_features, weight.bits, weight.group)
    if isinstance(weight, cpu_kernels.PackedWeight):
        return (weight.data, None, weight.out_features, 0, 0)
    return None


@dataclass(frozen=True)
class FusedDecoderLayer:
    ops: ModuleType
    linears: tuple[Linear, ...]  # qkv, o, gate_up, down
    weights: list[LayerLinear]
    norms: tuple[torch.Tensor, torch.Tensor, float]
    heads: list[int]  # H, KVH, head_dim
    scale: float

    @classmethod
    def of(cls, layer: DecoderLayer) -> FusedDecoderLayer | None:
        attention, mlp = layer.self_attn, layer.mlp
        ops = cpu_kernels.cpu_ops()
        if ops is None or not isinstance(attention.backend, CPUPagedAttention) or attention.has_qk_norm:
            return None
        if not isinstance(mlp, MLP):
            return None
        linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        weights = [_kernel_weight(linear) for linear in linears]
        if any(weight is None for weight in weights):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if norms[0].eps != norms[1].eps or norms[0].weight.dtype not in cpu_kernels.KERNEL_DTYPES:
            return None
        # Where the module's pointwise kernels apply (it falls back to torch's ops elsewhere).
        hidden, intermediate = norms[0].weight.shape[0], mlp.down_proj.in_features
        if attention.head_dim % 32 or hidden % 16 or intermediate % 16:
            return None
        heads = [attention.num_heads, attention.num_kv_heads, attention.head_dim]
        return cls(
            ops, linears, weights, (norms[0].weight, norms[1].weight, norms[0].eps), heads, attention.scale
        )  # type: ignore[arg-type]

    def __call__(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """DecoderLayer.forward's answer, or None where this step or layer needs the module."""
        if (step := _kernel_step(hidden, cos_sin, self.linears)) is None:
            return None
        dense_from, cos, sin = step
        return self.ops.decoder_layer(
            hidden,
            residual,
            self.norms,
            self.weights,
            self.heads,
            self.scale,
            cos,
            sin,
            *kv_cache,
            metadata.slot_mapping,
            metadata.kernel_args,
            dense_from,
        )


@dataclass(frozen=True)
class FusedDecoderStack:
    """Every layer of a model fused, run in one kernel call a step (kernels' DecoderStack: each
    layer's decoder_layer in turn, its weights handed over once): at a decode step's few rows,
    thirty calls from Python, each converting its layer's weights, cost about 7% of a 4-bit step
    (SmolLM2, batch 1, one thread)."""

    linears: tuple[Linear, ...]  # the first layer's, checked for an adapter's rows at each call
    stack: object  # the kernels' DecoderStack

    @classmethod
    def of(cls, layers: list[FusedDecoderLayer | None]) -> FusedDecoderStack | None:
        """None unless every layer is fused, with one head shape and scale."""
        if not layers or any(layer is None for layer in layers):
            return None
        fused = tuple(layer for layer in layers if layer is not None)
        first = fused[0]
        if any((layer.heads, layer.scale) != (first.heads, first.scale) for layer in fused):
            return None
        stack = first.ops.DecoderStack(
            [layer.norms for layer in fused], [layer.weights for layer in fused], first.heads, first.scale
        )
        return cls(first.linears, stack)

    def __call__(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last layer's (hidden, residual), or None where this step needs the layers one by one."""
        if (step := _kernel_step(hidden, cos_sin, self.linears)) is None:
            return None
        dense_from, cos, sin = step
        return self.stack.forward(  # type: ignore[attr-defined]
            hidden,
            residual,
            cos,
            sin,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            metadata.slot_mapping,
            metadata.kernel_args,
            dense_from,
        )


def _adapter_rows(linears: tuple[Linear, ...]) -> bool:
    """Whether this step adds an adapter's delta to these projections. LoRA attaches to every
    projection of every dense layer at once, all sharing one LoRAStep (lora/manager.py), so the
    first one's tells for all: a step with no adapter's rows leaves it inactive."""
    lora = linears[0].lora
    return lora is not None and lora.step.active


def _kernel_step(
    hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], linears: tuple[Linear, ...]
) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """quantized_linear's dense_from for this step's rows and its cos and sin as the kernels read
    them ([T, head_dim]); None where the rows need the modules (prompt rows interleaved with
    generated ones, or an adapter's rows in the step)."""
    dense_from = cpu_kernels.dense_from(hidden)
    if dense_from is None or _adapter_rows(linears):
        return None
    cos, sin = (t.reshape(hidden.shape[0], -1) for t in cos_sin)
    return dense_from, cos, sin
