"""Named real model shapes for `dummy:<shape>` (random weights, like vLLM's --load-format dummy)."""

from __future__ import annotations

from transformers import LlamaConfig, PretrainedConfig, Qwen3Config


def _smollm2_135m() -> PretrainedConfig:
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )


def _qwen3_0_6b() -> PretrainedConfig:
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def _llama3_8b() -> PretrainedConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


DUMMY_SHAPES = {
    "smollm2-135m": _smollm2_135m,
    "qwen3-0.6b": _qwen3_0_6b,
    "llama3-8b": _llama3_8b,
}
