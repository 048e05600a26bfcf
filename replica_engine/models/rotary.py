"""Rotary position embedding with a precomputed cos/sin table, computed the way Hugging Face
computes it (float32 position x inv_freq, rotate-half layout) so results match bit for bit."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from replica_engine.kernels import pointwise


def _inv_freq(config) -> tuple[torch.Tensor, float]:
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = rope["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"model: rope_type {rope_type!r} is not supported")
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = _inv_freq(config)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's rotation ([T, 1, d] cos and sin): looked up once per step, not per layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, d], k [T, kv_heads, d]; returns both rotated by their tokens' positions (in
    place, by the CPU kernel, where it applies)."""
    cos, sin = cos_sin
    if pointwise.rotary_(q, k, cos, sin):
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
