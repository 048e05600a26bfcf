"""Megatron-style tensor parallelism for the Llama family, applied to a loaded model: q/k/v and
gate/up split by output features (each worker its own heads and its share of the MLP), o_proj
and down_proj by input features with one all-reduce after each, the embeddings and the LM head
by vocabulary rows (a masked lookup summed across workers; logits gathered). Each worker's KV
cache then holds only its own KV heads, over the same block ids: the scheduler is unchanged.

A mixture-of-experts layer (models/moe.py) is split like an MLP inside every expert (each worker
a slice of each expert's width), or under expert parallelism by experts (each worker a run of
whole experts; the router stays whole everywhere). A shared expert is split like an MLP. Either
way the layer's partial outputs are summed across workers once."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from common.errors import InvalidRequestError
from replica_engine.models.layers import MLP, Linear, MergedLinear
from replica_engine.models.llama import LlamaForCausalLM
from replica_engine.models.moe import Experts, MoeShape, SparseMoeBlock


def check_divisible(config: PretrainedConfig, size: int, expert_parallel: bool = False) -> None:
    """Each worker takes an equal share of every split dimension, or the model is refused."""
    if size < 1:
        raise InvalidRequestError("tensor_parallel_size", f"must be at least 1, got {size}")
    moe = MoeShape.of(config)
    if expert_parallel and moe is None:
        raise InvalidRequestError("enable_expert_parallel", f"the model ({config.model_type}) has no experts")
    splits = {
        "query heads": config.num_attention_heads,
        "KV heads": config.num_key_value_heads,
        "vocabulary": config.vocab_size,
    }
    if moe is None or len(moe.sparse_layers) < config.num_hidden_layers:
        splits["MLP width"] = config.intermediate_size
    if moe is not None:
        splits["experts" if expert_parallel else "expert width"] = (
            moe.num_experts if expert_parallel else moe.expert_width
        )
        if moe.shared_width:
            splits["shared expert width"] = moe.shared_width
    for what, count in splits.items():
        if count % size:
            raise InvalidRequestError(
                "tensor_parallel_size", f"{size} does not divide the model's {count} {what}"
            )


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, rank: int, size: int, expert_parallel: bool = False) -> None:
    """Keep worker `rank`'s share of every weight (of `size` workers), in place."""
    if size == 1:
        return
    for layer in model.model.layers:
        attention = layer.self_attn
        _keep_output_shards(attention.qkv_proj, rank, size)
        attention.num_heads //= size
        attention.num_kv_heads //= size
        _keep_input_slice(attention.o_proj, rank, size)
        if isinstance(layer.mlp, SparseMoeBlock):
            _shard_experts(layer.mlp, rank, size, expert_parallel)
        else:
            _shard_mlp(layer.mlp, rank, size, sum_across_workers=True)
    vocab = model.config.vocab_size // size
    model.vocab_shard = (rank * vocab, (rank + 1) * vocab)
    embeddings = model.model.embed_tokens
    embeddings.weight = torch.nn.Parameter(_rows(embeddings.weight, rank, size))
    if not model.tie_word_embeddings:
        model.lm_head.weight = torch.nn.Parameter(_rows(model.lm_head.weight, rank, size))


def _shard_mlp(mlp: MLP, rank: int, size: int, sum_across_workers: bool) -> None:
    _keep_output_shards(mlp.gate_up_proj, rank, size)
    _keep_input_slice(mlp.down_proj, rank, size)
    mlp.down_proj.sum_across_workers = sum_across_workers


def _shard_experts(block: SparseMoeBlock, rank: int, size: int, expert_parallel: bool) -> None:
    """The block sums its parts once (the shared expert's partial output included)."""
    experts: Experts = block.experts
    assert experts.gate_up_proj is not None and experts.down_proj is not None, "split before packing"
    if expert_parallel:
        share = experts.num_experts // size
        experts.first, experts.num_experts = rank * share, share
        experts.gate_up_proj = torch.nn.Parameter(_rows(experts.gate_up_proj, rank, size))
        experts.down_proj = torch.nn.Parameter(_rows(experts.down_proj, rank, size))
    else:
        halves = experts.gate_up_proj.chunk(2, dim=1)  # gate | up: each cut by width
        width = halves[0].shape[1] // size
        experts.expert_width = width
        kept = [h[:, rank * width : (rank + 1) * width] for h in halves]
        experts.gate_up_proj = torch.nn.Parameter(torch.cat(kept, dim=1).contiguous())
        down = experts.down_proj[:, :, rank * width : (rank + 1) * width]
        experts.down_proj = torch.nn.Parameter(down.contiguous())
    if block.shared_expert is not None:
        _shard_mlp(block.shared_expert, rank, size, sum_across_workers=False)
    block.sum_across_workers = True


def _rows(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    share = weight.shape[0] // size
    return weight[rank * share : (rank + 1) * share].clone()


def _keep_output_shards(linear: MergedLinear, rank: int, size: int) -> None:
    """Each merged projection (q, k, v; gate, up) split by its output features."""
    pieces = [linear.shard_range(i) for i in range(len(linear.shard_sizes))]
    weights = [_rows(linear.weight[start:end], rank, size) for start, end in pieces]
    linear.weight = torch.nn.Parameter(torch.cat(weights))
    if linear.bias is not None:
        biases = [_rows(linear.bias[start:end], rank, size) for start, end in pieces]
        linear.bias = torch.nn.Parameter(torch.cat(biases))
    linear.shard_sizes = [n // size for n in linear.shard_sizes]
    linear.out_features //= size


def _keep_input_slice(linear: Linear, rank: int, size: int) -> None:
    share = linear.in_features // size
    linear.weight = torch.nn.Parameter(linear.weight[:, rank * share : (rank + 1) * share].clone())
    linear.in_features = share
    linear.sum_across_workers = True
