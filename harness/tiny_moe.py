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


def tiny_moe(architecture: str, seed: int = 0) -> torch.nn.Module:
    """The transformers model, float32, with its norms and biases moved off their initial values
    (so those code paths count)."""
    config: PretrainedConfig = CONFIGS[architecture]()
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
