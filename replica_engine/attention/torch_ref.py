"""Reference attention in plain torch: the oracle for the GPU kernels, and the CPU path.

Decode rows (one query each) are batched: every one gathers its blocks into a padded
[rows, max_len] layout and one SDPA call attends with a length mask. Prompt chunks loop per
request: gather its blocks, SDPA with a bottom-right causal mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replica_engine.attention.base import AttentionBackend, AttentionMetadata
from replica_engine.kv_cache_manager import blocks_for_tokens


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one request's paged cache, as [seq_len, kv_heads, head_dim]."""
    num_blocks = blocks_for_tokens(seq_len, cache.shape[1])
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def bottom_right_causal_mask(query_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Query j sits at absolute position kv_len - query_len + j and sees keys up to it."""
    query_pos = torch.arange(query_len, device=device)[:, None] + (kv_len - query_len)
    return torch.arange(kv_len, device=device)[None, :] <= query_pos


def _batched_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """query [R, heads, d], one per request -> [R, heads, d]."""
    num_blocks = blocks_for_tokens(max_len, k_cache.shape[1])
    # Padding entries point at the null block: read, then masked out below.
    tables = block_tables[:, :num_blocks].long()
    keys = k_cache[tables].flatten(1, 2)  # [R, num_blocks * block_size, kv_heads, d]
    values = v_cache[tables].flatten(1, 2)
    visible = torch.arange(keys.shape[1], device=query.device)[None, :] < seq_lens[:, None].long()
    out = F.scaled_dot_product_attention(
        query[:, :, None, :],  # [R, heads, 1, d]
        keys.transpose(1, 2),  # [R, kv_heads, L, d]
        values.transpose(1, 2),
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0, :]


class TorchAttention(AttentionBackend):
    name = "torch"

    @staticmethod
    def attend_decodes(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_len: int,
        scale: float,
    ) -> torch.Tensor:
        """Rows of one query each ([R, heads, d]) over their paged context -> [R, heads, d]."""
        return _batched_decode(query, k_cache, v_cache, block_tables, seq_lens, max_len, scale)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        output = torch.empty_like(query)
        decode = metadata.decode
        if decode is not None:
            output[decode.token_index] = self.attend_decodes(
                query[decode.token_index],
                k_cache,
                v_cache,
                decode.block_tables,
                decode.seq_lens,
                decode.max_seq_len,
                scale,
            )
        if metadata.max_query_len > 1:
            self.attend_prompts(query, k_cache, v_cache, metadata, scale, output)
        return output

    def attend_prompts(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """Into `output`: the rows of every request with more than one query row (prompt chunks)."""
        start = 0
        for i, (query_len, kv_len) in enumerate(
            zip(metadata.query_lens_cpu, metadata.seq_lens_kv_cpu, strict=True)
        ):
            end = start + query_len
            if query_len > 1:
                keys = gather_kv(k_cache, metadata.block_tables[i], kv_len)
                values = gather_kv(v_cache, metadata.block_tables[i], kv_len)
                # 4-d inputs: torch's CPU flash kernel takes those only (3-d falls back to the
                # unfused math path, 3-4x slower for a 512-token chunk).
                out = F.scaled_dot_product_attention(
                    query[None, start:end].transpose(1, 2),  # [1, heads, q, d]
                    keys[None].transpose(1, 2),  # [1, kv_heads, kv, d]
                    values[None].transpose(1, 2),
                    attn_mask=bottom_right_causal_mask(query_len, kv_len, query.device),
                    scale=scale,
                    enable_gqa=True,
                )
                output[start:end] = out[0].transpose(0, 1)
            start = end
