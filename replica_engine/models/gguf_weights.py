"""A GGUF file's quantized tensors served as they are: each linear layer (and the embeddings)
of a model already loaded from the file's converted directory takes the file's blocks in place of
its float weight (`quantization: gguf`), and so does each expert of a mixture (ffn_gate_exps,
ffn_up_exps, ffn_down_exps: 3D tensors, an expert's rows after another's) and a shared expert
(the *_shexp tensors); routers stay in float. Tensors of a type without a kernel keep their
float weight, named in the log."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from replica_engine.kernels.quantized_weight import QuantizedWeight, pack_quantized
from replica_engine.models.gguf_blocks import DECODERS, BlockCodes
from replica_engine.models.gguf_file import GgufTensor, read_tensors
from replica_engine.models.layers import Linear
from replica_engine.models.llama import LlamaForCausalLM
from replica_engine.models.moe import SparseMoeBlock

logger = logging.getLogger(__name__)

# GGUF name in blk.N -> (our module in the layer, shard of a merged projection)
ATTENTION_TENSORS = {
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0),
}
MLP_TENSORS = {
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
SHARED_EXPERT_TENSORS = {
    "ffn_gate_shexp": ("mlp.shared_expert.gate_up_proj", 0),
    "ffn_up_shexp": ("mlp.shared_expert.gate_up_proj", 1),
    "ffn_down_shexp": ("mlp.shared_expert.down_proj", 0),
}
# llama.cpp interleaves q and k rows for the Llama family's rotary layout, not for Qwen's
PERMUTED_ROTARY = ("llama", "mistral", "mixtral")


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


def _merged(blocks: list[BlockCodes]) -> QuantizedWeight:
    """Shards of one merged projection stacked by rows, in one format."""
    bits, group = max(b.bits for b in blocks), min(b.group for b in blocks)
    blocks = [_widened(b, bits, group) for b in blocks]
    codes, d, m = (torch.cat([getattr(b, part) for b in blocks]) for part in ("codes", "d", "m"))
    return pack_quantized(codes, d, m, bits, group)


def _hold(module: Linear, blocks: list[BlockCodes]) -> None:
    module.hold(_merged(blocks))


def _hold_experts(block: SparseMoeBlock, tensors: dict[str, GgufTensor], prefix: str) -> bool:
    """Each expert's gate|up and down from the layer's 3D tensors; False (the float weights kept)
    where a type has no kernel."""
    gate, up, down = (_decode(tensors[f"{prefix}.ffn_{w}_exps.weight"]) for w in ("gate", "up", "down"))
    if gate is None or up is None or down is None:
        return False
    width, hidden = block.shape.expert_width, block.gate.in_features
    weights = []
    for expert in range(block.shape.num_experts):
        rows = torch.arange(expert * width, (expert + 1) * width)  # this expert's, in gate and up
        down_rows = torch.arange(expert * hidden, (expert + 1) * hidden)
        weights.append((_merged([gate.rows(rows), up.rows(rows)]), _merged([down.rows(down_rows)])))
    block.experts.hold(weights)
    return True


@torch.no_grad()
def hold_gguf_weights(model: LlamaForCausalLM, gguf_path: Path) -> None:
    """Every linear layer and the embeddings from the file's quantized blocks, where a kernel
    has their type; the model's float copies of them are freed."""
    tensors = read_tensors(gguf_path)
    config, kept = model.config, []
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    permuted = config.model_type in PERMUTED_ROTARY
    for index, layer in enumerate(model.model.layers):
        layer_tensors = dict(ATTENTION_TENSORS)
        if isinstance(layer.mlp, SparseMoeBlock):
            if not _hold_experts(layer.mlp, tensors, f"blk.{index}"):
                kept.append(f"layers.{index}.mlp.experts")
            if layer.mlp.shared_expert is not None:
                layer_tensors.update(SHARED_EXPERT_TENSORS)
        else:
            layer_tensors.update(MLP_TENSORS)
        shards: dict[str, list[BlockCodes | None]] = {}
        for suffix, (module_name, _) in layer_tensors.items():
            tensor = tensors[f"blk.{index}.{suffix}.weight"]
            rows = rotary_rows(tensor.shape[0], heads[suffix]) if suffix in heads and permuted else None
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
