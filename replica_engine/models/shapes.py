"""Named real model shapes for `dummy:<shape>` (random weights, like vLLM's --load-format dummy)."""

from __future__ import annotations

from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

# Published configs of the real models, cut to what shapes the weights and the attention.
_SHAPES: dict[str, tuple[type[PretrainedConfig], dict[str, object]]] = {
    "smollm2-135m": (
        LlamaConfig,
        dict(
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
        ),
    ),
    # Not a published model: a toy Llama for load tests and soaks, where the point is the
    # serving path (scheduling, KV accounting, streaming, cancellation), not the model's math.
    "tiny-llama": (
        LlamaConfig,
        dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-0.6b": (
        Qwen3Config,
        dict(
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
        ),
    ),
    "llama3-8b": (
        LlamaConfig,
        dict(
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
        ),
    ),
}

DUMMY_SHAPES = sorted(_SHAPES)


def dummy_config(shape: str) -> PretrainedConfig:
    config_class, settings = _SHAPES[shape]
    return config_class(**settings)
