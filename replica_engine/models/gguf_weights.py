"""A GGUF file's quantized tensors served as they are: each linear layer (and the embeddings)
of a model already loaded from the file's converted directory takes the file's blocks in place of
its float weight (`quantization: gguf`). Tensors of a type without a kernel keep their float
weight, named in the log."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from replica_engine.kernels.quantized_weight import pack_quantized
from replica_engine.models.gguf_blocks import DECODERS, BlockCodes
from replica_engine.models.gguf_file import GgufTensor, read_tensors
from replica_engine.models.layers import Linear
from replica_engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# GGUF name in blk.N -> (our module in the layer, shard of a merged projection)
LAYER_TENSORS = {
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}


def rotary_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each q and k head's rotary halves (row j of the first
    half, then of the second); these indices put the rows back in Hugging Face's order."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, half, 2).transpose(1, 2).reshape(-1)


def _decode(tensor: GgufTensor, rows: torch.Tensor | None = None) -> BlockCodes | None:
    if tensor.type_name not in DECODERS:
        return None
    block = DECODERS[tensor.type_name](torch.from_numpy(tensor.data.copy()))
    return block if rows is None else block.rows(rows)


def _widened(block: BlockCodes, bits: int, group: int) -> BlockCodes:
    """The same values in a wider format (4-bit codes as 8-bit ones, groups of 32 as pairs of 16):
    shards of one merged projection may come in different types (Q4_K_M's attn_v is Q6_K)."""
    repeat = block.group // group
    d, m = block.d.repeat_interleave(repeat, dim=1), block.m.repeat_interleave(repeat, dim=1)
    return BlockCodes(block.codes, d, m, bits, group)


def _hold(module: Linear, blocks: list[BlockCodes]) -> None:
    bits, group = max(b.bits for b in blocks), min(b.group for b in blocks)
    blocks = [_widened(b, bits, group) for b in blocks]
    codes, d, m = (torch.cat([getattr(b, part) for b in blocks]) for part in ("codes", "d", "m"))
    module.hold(pack_quantized(codes, d, m, bits, group))


@torch.no_grad()
def hold_gguf_weights(model: LlamaForCausalLM, gguf_path: Path) -> None:
    """Every linear layer and the embeddings from the file's quantized blocks, where a kernel
    has their type; the model's float copies of them are freed."""
    tensors = read_tensors(gguf_path)
    config, kept = model.config, []
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for index, layer in enumerate(model.model.layers):
        shards: dict[str, list[BlockCodes | None]] = {}
        for suffix, (module_name, _) in LAYER_TENSORS.items():
            tensor = tensors[f"blk.{index}.{suffix}.weight"]
            rows = rotary_rows(tensor.shape[0], heads[suffix]) if suffix in heads else None
            shards.setdefault(module_name, []).append(_decode(tensor, rows))
        for module_name, blocks in shards.items():
            if all(b is not None for b in blocks):
                _hold(layer.get_submodule(module_name), blocks)
            else:
                kept.append(f"layers.{index}.{module_name}")
    embeddings = _decode(tensors["token_embd.weight"])
    if embeddings is not None:
        model.hold_embeddings(embeddings.packed())
    if not model.tie_word_embeddings:
        output = _decode(tensors["output.weight"]) if "output.weight" in tensors else None
        if output is not None:
            _hold(model.lm_head, [output])
    if kept:
        logger.warning("GGUF tensors of types without a kernel stay dequantized: %s", ", ".join(kept))
