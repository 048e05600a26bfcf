"""Megatron-style tensor parallelism for the Llama family, applied to a loaded model: q/k/v and
gate/up split by output features (each worker its own heads and its share of the MLP), o_proj
and down_proj by input features with one all-reduce after each, the embeddings and the LM head
by vocabulary rows (a masked lookup summed across workers; logits gathered). Each worker's KV
cache then holds only its own KV heads, over the same block ids: the scheduler is unchanged."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from common.errors import InvalidRequestError
from replica_engine.models.llama import Linear, LlamaForCausalLM, MergedLinear


def check_divisible(config: PretrainedConfig, size: int) -> None:
    """Each worker takes an equal share of every split dimension, or the model is refused."""
    if size < 1:
        raise InvalidRequestError("tensor_parallel_size", f"must be at least 1, got {size}")
    splits = {
        "query heads": config.num_attention_heads,
        "KV heads": config.num_key_value_heads,
        "MLP width": config.intermediate_size,
        "vocabulary": config.vocab_size,
    }
    for what, count in splits.items():
        if count % size:
            raise InvalidRequestError(
                "tensor_parallel_size", f"{size} does not divide the model's {count} {what}"
            )


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, rank: int, size: int) -> None:
    """Keep worker `rank`'s share of every weight (of `size` workers), in place."""
    if size == 1:
        return
    for layer in model.model.layers:
        attention = layer.self_attn
        _keep_output_shards(attention.qkv_proj, rank, size)
        attention.num_heads //= size
        attention.num_kv_heads //= size
        _keep_input_slice(attention.o_proj, rank, size)
        _keep_output_shards(layer.mlp.gate_up_proj, rank, size)
        _keep_input_slice(layer.mlp.down_proj, rank, size)
    vocab = model.config.vocab_size // size
    model.vocab_shard = (rank * vocab, (rank + 1) * vocab)
    embeddings = model.model.embed_tokens
    embeddings.weight = torch.nn.Parameter(_rows(embeddings.weight, rank, size))
    if not model.tie_word_embeddings:
        model.lm_head.weight = torch.nn.Parameter(_rows(model.lm_head.weight, rank, size))


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
