"""Triton paged attention: one launch for a whole flat varlen batch, prompt chunks and decodes
together (Sarathi's mixed steps), reading K/V straight from the paged cache.

Program (request, head, query tile) takes BLOCK_M query rows of one request and walks that
request's blocks one KV block at a time with an online softmax (FlashAttention's recurrence).
Query row j of a request sits at absolute position kv_len - query_len + j and sees keys up to
it (bottom-right causal mask); blocks wholly after a tile's last row are not read. GQA maps
query head h to KV head h // (heads / kv_heads). On CPU it runs under TRITON_INTERPRET=1, which
is how the tests check it against the torch reference without a GPU."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from replica_engine.attention.base import AttentionBackend, AttentionMetadata

BLOCK_M = 16  # query rows per program; a decode uses one of them
# Float32 inputs are multiplied at full precision, not in a GPU's default TF32. Triton's
# interpreter multiplies bf16 tiles as raw integers (numpy has no bf16), so there they are
# multiplied as float32: exact products of bf16 values, summed in float32, as a GPU's bf16 dot does.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _paged_attention_kernel(
    query_ptr,  # [T, heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [T, heads, head_dim]
    cu_seqlens_q_ptr,  # [num_reqs + 1]
    seq_lens_kv_ptr,  # [num_reqs]
    block_tables_ptr,  # [num_reqs, max_blocks]
    scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_ot,
    stride_oh,
    stride_bt,
    num_queries_per_kv: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block, one block per loop step
    BLOCK_M: tl.constexpr,
    FLOAT32_DOT: tl.constexpr,  # multiply float32 tiles at full precision (see the launch)
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    query_start = tl.load(cu_seqlens_q_ptr + request)
    query_len = tl.load(cu_seqlens_q_ptr + request + 1) - query_start
    if tile * BLOCK_M >= query_len:
        return
    kv_len = tl.load(seq_lens_kv_ptr + request)
    kv_head = head // num_queries_per_kv

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < query_len
    query_pos = kv_len - query_len + rows  # absolute positions of this tile's queries
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        query_ptr + (query_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Causal: no key after the tile's last query position is needed.
    last_pos = tl.minimum(kv_len - query_len + (tile + 1) * BLOCK_M, kv_len)
    num_blocks = tl.cdiv(last_pos, BLOCK_SIZE)
    offsets = tl.arange(0, BLOCK_SIZE)
    for block_index in range(0, num_blocks):
        physical = tl.load(block_tables_ptr + request * stride_bt + block_index).to(tl.int64)
        key_pos = block_index * BLOCK_SIZE + offsets
        key_valid = key_pos < kv_len
        cache_offsets = (
            physical * stride_cb + offsets[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
        )
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + cache_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + cache_offsets, mask=kv_mask, other=0.0)

        if FLOAT32_DOT:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores.to(tl.float32) * scale  # [BLOCK_M, BLOCK_SIZE]
        visible = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        block_max = tl.max(scores, 1)
        new_max = tl.maximum(running_max, block_max)
        # Rows that have seen no visible key yet keep a -inf max: subtract 0 there, not -inf.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - safe_max[:, None])
        correction = tl.exp(running_max - safe_max)
        running_sum = running_sum * correction + tl.sum(probs, 1)
        if FLOAT32_DOT:
            weighted = tl.dot(probs.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            weighted = tl.dot(probs.to(v.dtype), v)
        acc = acc * correction[:, None] + weighted.to(tl.float32)
        running_max = new_max

    out = acc / tl.where(running_sum == 0, 1.0, running_sum)[:, None]
    tl.store(
        out_ptr + (query_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


class TritonAttention(AttentionBackend):
    name = "triton"

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16 for the triton backend, got {block_size}")
        output = torch.empty_like(query)
        num_requests = metadata.seq_lens_kv.shape[0]
        grid = (num_requests, num_heads, triton.cdiv(metadata.max_query_len, BLOCK_M))
        _paged_attention_kernel[grid](
            query,
            k_cache,
            v_cache,
            output,
            metadata.cu_seqlens_q,
            metadata.seq_lens_kv,
            metadata.block_tables,
            scale,
            query.stride(0),
            query.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            output.stride(0),
            output.stride(1),
            metadata.block_tables.stride(0),
            num_queries_per_kv=num_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
            BLOCK_M=BLOCK_M,
            FLOAT32_DOT=query.dtype == torch.float32 or _INTERPRETED,
        )
        return output
