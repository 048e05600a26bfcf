"""The mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE: a router picks each token's
top-k experts (softmax first, then top-k, renormalised where the config says), each expert is a
gated MLP, and a Qwen2-MoE layer adds a shared expert behind a sigmoid gate.

The experts' weights are stacked, [E, 2I, H] (gate | up) and [E, H, I] (down), as transformers
holds them. A GPU runs them in two Triton launches over tokens sorted by expert (triton_moe.py).
A CPU with our kernels runs a layer's experts in one call, tokens grouped by expert and each
active expert's weights streamed in one parallel region: packed_moe for packed float weights,
quantized_moe for int8 or GGUF ones; with AMX copies (amx_weights) they go one matmul pair per
active expert through kernels/cpu.py's linear. Either way a decode step reads only the experts
its batch touches.

Under tensor parallelism each worker holds a slice of every expert's width; under expert
parallelism (EngineConfig.enable_expert_parallel) a run of whole experts. Either way every worker
sees all tokens (attention's output is summed across workers), computes its part, and the parts
are summed once per layer, shared expert included."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from replica_engine.kernels import cpu as cpu_kernels
from replica_engine.kernels import pointwise
from replica_engine.kernels.quantized_weight import QuantizedWeight, stack_quantized, unstacked
from replica_engine.models.layers import MLP, Linear

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")

KernelWeight = torch.Tensor | cpu_kernels.PackedWeight | QuantizedWeight | cpu_kernels.TiledWeight


@dataclass(frozen=True)
class MoeShape:
    """A config's experts, read the way its transformers model reads them."""

    num_experts: int
    top_k: int
    expert_width: int  # each expert's intermediate size
    norm_topk_prob: bool  # the top-k probabilities rescaled to sum to 1
    shared_width: int  # the shared expert's intermediate size; 0: none
    sparse_layers: frozenset[int]  # the layers with experts; the others have a dense MLP

    @classmethod
    def of(cls, config) -> MoeShape | None:
        """None for a dense model."""
        layers = range(config.num_hidden_layers)
        if config.model_type == "mixtral":
            return cls(
                config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                True, 0, frozenset(layers),
            )  # fmt: skip
        if config.model_type not in ("qwen2_moe", "qwen3_moe"):
            return None
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        step = config.decoder_sparse_step
        sparse = {i for i in layers if i not in dense and config.num_experts > 0 and (i + 1) % step == 0}
        return cls(
            config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            bool(config.norm_topk_prob), getattr(config, "shared_expert_intermediate_size", 0) or 0,
            frozenset(sparse),
        )  # fmt: skip

    def expert_bytes(self, hidden: int, bytes_per_value: float) -> float:
        """One expert's weights (gate, up, down) in one layer."""
        return 3 * hidden * self.expert_width * bytes_per_value


class Experts(nn.Module):
    """A layer's experts (or, under expert parallelism, a worker's run of them, from `first`)."""

    def __init__(self, num_experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.down_proj: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.num_experts = num_experts  # held here
        self.expert_width = width  # under tensor parallelism, this worker's slice of it
        self.first = 0  # the global id of the first expert held here
        # On the CPU: packed float weights stacked for packed_moe (gate_up, down); quantized ones
        # stacked for quantized_moe, with per-expert views of them; or AMX-tiled ones per expert.
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.quantized: tuple[QuantizedWeight, QuantizedWeight] | None = None
        self.kernel_weights: list[tuple[KernelWeight, KernelWeight]] | None = None

    def forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """sum over each token's picked experts held here of weight * expert(x): [T, H]."""
        if x.is_cuda:
            from replica_engine.kernels import triton_moe

            assert self.gate_up_proj is not None and self.down_proj is not None
            local = top_ids - self.first
            return triton_moe.fused_moe(x, self.gate_up_proj, self.down_proj, local, top_weights)
        if self.packed is not None:
            gate_up, down = self.packed
            return cpu_kernels.packed_moe(
                x, top_ids, top_weights, gate_up, down, self.first, self.expert_width
            )
        if self.quantized is not None:
            gate_up_q, down_q = self.quantized
            width = self.expert_width
            out = cpu_kernels.quantized_moe(x, top_ids, top_weights, gate_up_q, down_q, self.first, width)
            if out is not None:
                return out
        return self._grouped(x, top_ids, top_weights)

    def _grouped(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert; one matmul pair per expert with any."""
        local = top_ids - self.first
        flat = local.flatten()
        held = ((flat >= 0) & (flat < self.num_experts)).nonzero().squeeze(1)
        order = held[flat[held].argsort(stable=True)]  # (token, slot) pairs, by expert
        counts = torch.bincount(flat[order], minlength=self.num_experts).tolist()
        tokens = order // local.shape[1]
        rows, outs, start = x[tokens], [], 0
        for expert, count in enumerate(counts):
            if count:
                gate_up, down = self._weights(expert)
                hidden = pointwise.silu_mul(cpu_kernels.linear(rows[start : start + count], gate_up))
                outs.append(cpu_kernels.linear(hidden, down))
                start += count
        out = torch.zeros_like(x)
        if outs:
            weighted = torch.cat(outs).float() * top_weights.flatten()[order, None].float()
            out.index_add_(0, tokens, weighted.to(x.dtype))
        return out

    def _weights(self, expert: int) -> tuple[KernelWeight, KernelWeight]:
        if self.kernel_weights is not None:
            return self.kernel_weights[expert]
        assert self.gate_up_proj is not None and self.down_proj is not None
        return self.gate_up_proj[expert], self.down_proj[expert]

    def hold(self, weights: list[tuple[QuantizedWeight, QuantizedWeight]]) -> None:
        """Serve from quantized per-expert weights (stacked where every expert's projection has
        one format, for quantized_moe); the float ones are freed."""
        assert len(weights) == self.num_experts
        self.kernel_weights, self.gate_up_proj, self.down_proj = list(weights), None, None
        gate_up, down = (stack_quantized([pair[i] for pair in weights]) for i in (0, 1))
        if gate_up is not None and down is not None:  # the per-expert weights become views
            self.quantized = (gate_up, down)
            self.kernel_weights = [
                (unstacked(gate_up, e), unstacked(down, e)) for e in range(self.num_experts)
            ]

    def pack_for_cpu(self, amx_weights: bool = False) -> None:
        """The CPU kernels' layouts (as layers.Linear.pack_for_cpu does for one weight): float
        weights packed and stacked for packed_moe, or, with AMX copies, per expert; quantized
        ones get their AMX copies. Where the kernels do not apply, the float weights stay."""
        if self.kernel_weights is not None:
            if amx_weights:  # steps of many rows multiply AMX copies, expert by expert
                self.quantized = None
                self.kernel_weights = [
                    (cpu_kernels.tiled_weight(g, None), cpu_kernels.tiled_weight(d, None))  # type: ignore[arg-type]
                    for g, d in self.kernel_weights
                ]
            return
        assert self.gate_up_proj is not None and self.down_proj is not None
        stacked = (self.gate_up_proj, self.down_proj)
        if amx_weights:
            packed = [tuple(cpu_kernels.pack_weight(w[e]) for w in stacked) for e in range(self.num_experts)]
            if any(p is None for pair in packed for p in pair):
                return
            self.kernel_weights = [
                (cpu_kernels.tiled_weight(g, stacked[0][e]), cpu_kernels.tiled_weight(d, stacked[1][e]))  # type: ignore[arg-type]
                for e, (g, d) in enumerate(packed)
            ]
        else:
            gate_up, down = (cpu_kernels.pack_stacked(w.detach()) for w in stacked)
            if gate_up is None or down is None or self.expert_width % 16:
                return
            self.packed = (gate_up, down)
        self.gate_up_proj = self.down_proj = None


class SparseMoeBlock(nn.Module):
    """`gate` (the router: never quantized, its logits in float32), `experts`, and Qwen2-MoE's
    `shared_expert` with its `shared_expert_gate`: transformers' names."""

    def __init__(self, config, shape: MoeShape) -> None:
        super().__init__()
        self.shape = shape
        self.gate = Linear(config.hidden_size, shape.num_experts, bias=False)
        self.experts = Experts(shape.num_experts, config.hidden_size, shape.expert_width)
        self.shared_expert: MLP | None = None
        if shape.shared_width:
            self.shared_expert = MLP(config.hidden_size, shape.shared_width)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.sum_across_workers = False  # under tensor or expert parallelism: each worker a part

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k expert ids [T, k] and their weights (float32)."""
        logits = cpu_kernels.linear(x, self.gate.packed or self.gate.weight, float32_out=True)
        probs = F.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.shape.top_k, dim=-1)
        if self.shape.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x) * torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
            out = out + shared
        if self.sum_across_workers:
            dist.all_reduce(out)
        return out
