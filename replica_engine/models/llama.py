"""Our flat-token Llama family (Llama, Mistral, Qwen2, Qwen3, and with experts in place of the MLP
Mixtral, Qwen2-MoE and Qwen3-MoE: models/moe.py): every op works on [T, hidden], where T is all
scheduled tokens of all requests; attention goes through the backend."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from replica_engine.attention.base import AttentionBackend, AttentionMetadata
from replica_engine.kernels import cpu as cpu_kernels
from replica_engine.kernels import pointwise
from replica_engine.kernels.quantized_weight import QuantizedWeight
from replica_engine.models.fused_layer import FusedDecoderLayer, FusedDecoderStack
from replica_engine.models.layers import MLP, Embedding, Linear, MergedLinear, RMSNorm
from replica_engine.models.moe import MOE_MODEL_TYPES, Experts, MoeShape, SparseMoeBlock
from replica_engine.models.rotary import RotaryEmbedding, apply_rotary

CosSin = tuple[torch.Tensor, torch.Tensor]  # every token's rotary cos and sin, [T, 1, head_dim]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)


class Attention(nn.Module):
    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        qkv_bias = config.model_type in ("qwen2", "qwen2_moe") or getattr(config, "attention_bias", False)
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.num_heads * self.head_dim, kv_size, kv_size], bias=qkv_bias
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.has_qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.backend = backend

    def forward(
        self,
        cos_sin: CosSin,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if not pointwise.rotary_store_(q, k, v, cos_sin, kv_cache, metadata.slot_mapping):
            q, k = apply_rotary(q, k, cos_sin)
            self.backend.write_kv(k, v, *kv_cache, metadata.slot_mapping)
        out = self.backend.attend(q, *kv_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    fused: FusedDecoderLayer | None = None  # on a CPU, where the layer is plain (fused_layer.py)

    def __init__(self, config, backend: AttentionBackend, moe: MoeShape | None) -> None:
        """`moe`: the model's experts where this layer has them; None: a dense MLP."""
        super().__init__()
        self.self_attn = Attention(config, backend)
        self.mlp: MLP | SparseMoeBlock
        if moe is not None:
            self.mlp = SparseMoeBlock(config, moe)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        cos_sin: CosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the last sublayer's output, not yet added to the residual stream (the first
        layer: the embeddings, residual None). Each add is fused into the norm that follows it."""
        if self.fused is not None and (answer := self.fused(cos_sin, hidden, residual, kv_cache, metadata)):
            return answer
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        moe = MoeShape.of(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, moe if moe is not None and i in moe.sparse_layers else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class PipelineStage:
    """Under pipeline parallelism: which of `count` stages this worker is (its rank, with no
    tensor parallelism), holding a contiguous run of the layers."""

    index: int
    count: int
    waited_s: float = 0.0  # blocked receiving from the stage before or sending to the next: idle

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


class LlamaForCausalLM(nn.Module):
    """Hugging Face parameter names, except the merged qkv_proj and gate_up_proj (see loader)."""

    def __init__(self, config, backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model: architecture {config.model_type!r} is not supported; have {SUPPORTED_MODEL_TYPES}"
            )
        self.config = config
        self.model = LlamaModel(config, backend)
        self.rotary = RotaryEmbedding(config, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Under tensor parallelism: the vocabulary rows this worker holds (embeddings and LM head).
        self.vocab_shard: tuple[int, int] | None = None
        self.stage: PipelineStage | None = None  # under pipeline parallelism: model.layers are its own
        # The logits' copy of tied embeddings: packed (pack_for_cpu), or quantized (hold_embeddings).
        self.packed_embeddings: cpu_kernels.PackedWeight | QuantizedWeight | None = None
        self.quantized_embeddings: QuantizedWeight | None = None  # looked up in place of embed_tokens
        self.fused_stack: FusedDecoderStack | None = None  # on a CPU, where every layer is fused
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The last hidden states, normed; None on a pipeline stage that is not the last (it
        sends its layers' output, and the residual stream, on to the next stage)."""
        stage = self.stage
        if stage is None or stage.first:
            hidden, residual = self._embed(input_ids), None
        else:
            hidden, residual = self._receive(input_ids.shape[0], stage)
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)
        stack = self.fused_stack
        if stack is not None and (answer := stack(cos_sin, hidden, residual, kv_caches, metadata)):
            hidden, residual = answer
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                hidden, residual = layer(cos_sin, hidden, residual, kv_cache, metadata)
        if stage is not None and not stage.last:
            assert residual is not None  # every stage holds a layer
            both = torch.stack((hidden, residual))
            started = time.perf_counter()
            dist.send(both, stage.index + 1)
            stage.waited_s += time.perf_counter() - started
            return None
        return self.model.norm.add_and_norm(hidden, residual)[0]

    def _receive(self, num_tokens: int, stage: PipelineStage) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.model.layers[0].input_layernorm.weight
        both = torch.empty((2, num_tokens, self.config.hidden_size), dtype=weight.dtype, device=weight.device)
        started = time.perf_counter()
        dist.recv(both, stage.index - 1)
        stage.waited_s += time.perf_counter() - started
        return both[0], both[1]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized_embeddings is not None:
            dtype = self.model.norm.weight.dtype
            return cpu_kernels.embedding_rows(self.quantized_embeddings, input_ids, dtype)
        if self.vocab_shard is None:
            return self.model.embed_tokens(input_ids)
        start, end = self.vocab_shard  # rows of ids outside the shard are zero here, summed below
        held = (input_ids >= start) & (input_ids < end)
        hidden = F.embedding((input_ids - start) * held, self.model.embed_tokens.weight) * held[:, None]
        dist.all_reduce(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = cpu_kernels.linear(hidden, self._logits_weight(), float32_out=True)
        if self.vocab_shard is None:
            return logits
        shards = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, logits.contiguous())
        return torch.cat(shards, dim=-1)

    def _logits_weight(self) -> torch.Tensor | cpu_kernels.PackedWeight | QuantizedWeight:
        if self.tie_word_embeddings:
            return self.packed_embeddings or self.model.embed_tokens.weight
        return self.lm_head.packed or self.lm_head.weight

    def hold_embeddings(self, weight: QuantizedWeight) -> None:
        """Look tokens up in a quantized embedding (and, when tied, compute the logits with it);
        the float one is freed."""
        self.quantized_embeddings = weight
        if self.tie_word_embeddings:
            self.packed_embeddings = weight
        self.model.embed_tokens.weight = None

    @torch.no_grad()
    def pack_for_cpu(self, amx_weights: bool = False) -> None:
        """Every linear layer's weight (and every expert's) repacked for the CPU kernel (where it
        applies), with a bfloat16 copy for AMX if asked. Tied embeddings keep their rows for the
        lookup and get a packed copy for the logits (rows of the sampled tokens only: no AMX copy)."""
        for module in self.modules():
            if isinstance(module, Linear | Experts):
                module.pack_for_cpu(amx_weights)
        if self.tie_word_embeddings and self.packed_embeddings is None:
            self.packed_embeddings = cpu_kernels.pack_weight(self.model.embed_tokens.weight)
        for layer in self.model.layers:
            layer.fused = FusedDecoderLayer.of(layer)
        self.fused_stack = FusedDecoderStack.of([layer.fused for layer in self.model.layers])
