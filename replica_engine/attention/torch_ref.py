"""Reference attention: gather each request's blocks, then SDPA with a bottom-right causal mask.
Slow (a Python loop over requests) but plainly right; the oracle for the GPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replica_engine.attention.base import AttentionBackend, AttentionMetadata


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one request's paged cache, as [seq_len, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def bottom_right_causal_mask(query_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Query j sits at absolute position kv_len - query_len + j and sees keys up to it."""
    query_pos = torch.arange(query_len, device=device)[:, None] + (kv_len - query_len)
    return torch.arange(kv_len, device=device)[None, :] <= query_pos


class TorchAttention(AttentionBackend):
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        output = torch.empty_like(query)
        start = 0
        for i, (query_len, kv_len) in enumerate(
            zip(metadata.query_lens_cpu, metadata.seq_lens_kv_cpu, strict=True)
        ):
            end = start + query_len
            keys = gather_kv(k_cache, metadata.block_tables[i], kv_len)
            values = gather_kv(v_cache, metadata.block_tables[i], kv_len)
            mask = None if query_len == 1 else bottom_right_causal_mask(query_len, kv_len, query.device)
            out = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1),  # [heads, q, d]
                keys.transpose(0, 1),  # [kv_heads, kv, d]
                values.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
            output[start:end] = out.transpose(0, 1)
            start = end
        return output
