"""Tiny random mixture-of-experts checkpoints, as vLLM's tests use `TitanML/tiny-mixtral`: here
transformers' own random initialisation of a small config, saved as a Hugging Face directory
with the embedded SmolLM2's tokenizer and chat template (its vocabulary size), no download."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig

_COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    num_experts_per_tok=2,
)
CONFIGS = {
    # q/k norms; the middle layer a dense MLP (mlp_only_layers); top-k renormalised
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_COMMON,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        head_dim=16,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # always renormalised; every layer sparse
    "mixtral": lambda: MixtralConfig(**_COMMON, intermediate_size=32, num_local_experts=4),
    # q/k/v biases, a shared expert behind a sigmoid gate, top-k not renormalised
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **_COMMON,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        norm_topk_prob=False,
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def tiny_moe(architecture: str, seed: int = 0, **changes: object) -> torch.nn.Module:
    """The transformers model, float32, with its norms and biases moved off their initial values
    (so those code paths count); `changes` to its config."""
    config: PretrainedConfig = CONFIGS[architecture]()
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.5)
            if name.endswith("gate.weight"):  # a router that prefers some experts, as a trained one
                param.normal_(0, 0.5)
    return model


def save_tiny_moe(model: torch.nn.Module, directory: Path, tokenizer_dir: Path) -> Path:
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


# Hugging Face name in a layer -> GGUF name in blk.N (llama.cpp's names for qwen3moe)
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm",
    "self_attn.k_norm.weight": "attn_k_norm",
    "mlp.gate.weight": "ffn_gate_inp",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
}


def write_qwen3_moe_gguf(
    model: torch.nn.Module, path: Path, tokenizer_gguf: Path, quantized: str = "Q8_0"
) -> Path:
    """A tiny Qwen3-MoE (tiny_moe("qwen3_moe", mlp_only_layers=[]): transformers' GGUF loader
    reads no dense layers) as llama.cpp's converter would write it: the
    `qwen3moe` architecture, each layer's experts as 3D tensors (ffn_gate_exps, ffn_up_exps,
    ffn_down_exps) and every matrix in `quantized` blocks (norms, the router and the embeddings in
    float32), with the tokenizer of `tokenizer_gguf` (the embedded SmolLM2's) copied over."""
    import gguf
    import numpy as np

    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_vocab_size(config.vocab_size)
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, value_type, sub_type=sub_type)
    qtype = gguf.GGMLQuantizationType[quantized]

    def add(name: str, tensor: torch.Tensor) -> None:
        values = tensor.detach().float().numpy()
        if (
            values.ndim == 1
            or "norm" in name
            or name.endswith("gate_inp.weight")
            or name == "token_embd.weight"
        ):
            writer.add_tensor(name, values.astype(np.float32))
            return
        blocks = gguf.quants.quantize(values.reshape(-1, values.shape[-1]), qtype)
        writer.add_tensor(name, blocks.reshape(*values.shape[:-1], -1), raw_dtype=qtype)

    state = model.state_dict()
    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    for index in range(config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        for ours, theirs in _GGUF_LAYER_NAMES.items():
            if prefix + ours in state:
                add(f"blk.{index}.{theirs}.weight", state[prefix + ours])
        if prefix + "mlp.experts.gate_up_proj" in state:
            gate, up = state[prefix + "mlp.experts.gate_up_proj"].chunk(2, dim=1)  # [E, I, H] each
            add(f"blk.{index}.ffn_gate_exps.weight", gate)
            add(f"blk.{index}.ffn_up_exps.weight", up)
            add(f"blk.{index}.ffn_down_exps.weight", state[prefix + "mlp.experts.down_proj"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
