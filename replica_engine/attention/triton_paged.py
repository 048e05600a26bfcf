"""Triton paged attention: one launch for a whole flat varlen batch, prompt chunks and decodes
together (Sarathi's mixed steps), reading K/V straight from the paged cache.

Program (request, KV head, tile) takes BLOCK_M rows of one request: (query row, query head)
pairs of the heads that share that KV head (GQA), packed row-major. So each K/V tile is read
once for all of a group's heads, not once per head: a decode of Llama-3-8B (4 heads per KV
head) fills 4 rows and reads the cache a quarter as often (the H200 showed decode steps bound
by this kernel's reads). It walks the request's keys TILE_N at a time, gathering each key's
block from the block table, with an online softmax (FlashAttention's recurrence). Query row j
of a request sits at absolute position kv_len - query_len + j and sees keys up to it
(bottom-right causal mask); tiles wholly after a program's last row are not read. On CPU it runs
under TRITON_INTERPRET=1, which is how the tests check it against the torch reference."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from replica_engine.attention.base import AttentionBackend, AttentionMetadata

DECODE_BLOCK_M = 16  # packed rows per program when every request has one query row (tl.dot's least)
PREFILL_BLOCK_M = 64
TILE_N = 64  # keys per loop step: several KV blocks in flight at once
# Float32 inputs are multiplied at full precision, not in a GPU's default TF32. Triton's
# interpreter multiplies bf16 tiles as raw integers (numpy has no bf16), so there they are
# multiplied as float32: exact products of bf16 values, summed in float32, as a GPU's bf16 dot does.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# Triton compiles a kernel again for each new "divisible by 16" (or "is 1") of an int argument: the
# block tables' width changes from step to step, and a compile mid-run stalls the step loop.
@triton.jit(do_not_specialize=["stride_bt"])
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
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_M: tl.constexpr,  # packed (query row, head) rows per program
    TILE_N: tl.constexpr,  # keys per loop step
    FLOAT32_DOT: tl.constexpr,  # multiply float32 tiles at full precision (see the launch)
):
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    query_start = tl.load(cu_seqlens_q_ptr + request)
    query_len = tl.load(cu_seqlens_q_ptr + request + 1) - query_start
    if tile * BLOCK_M >= query_len * num_queries_per_kv:
        return
    kv_len = tl.load(seq_lens_kv_ptr + request)

    packed = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = packed // num_queries_per_kv  # query row within the request
    heads = kv_head * num_queries_per_kv + packed % num_queries_per_kv
    row_valid = rows < query_len
    query_pos = kv_len - query_len + rows  # absolute positions of this tile's queries
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q_offsets = (query_start + rows)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Causal: no key after the tile's last query position is needed.
    last_row = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // num_queries_per_kv, query_len - 1)
    last_pos = kv_len - query_len + last_row + 1
    offsets = tl.arange(0, TILE_N)
    for start in range(0, tl.cdiv(last_pos, TILE_N)):
        key_pos = start * TILE_N + offsets
        key_valid = key_pos < last_pos
        physical = tl.load(
            block_tables_ptr + request * stride_bt + key_pos // BLOCK_SIZE, mask=key_valid, other=0
        ).to(tl.int64)
        cache_offsets = (
            physical[:, None] * stride_cb
            + (key_pos % BLOCK_SIZE)[:, None] * stride_cs
            + kv_head * stride_ch
            + dims[None, :]
        )
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + cache_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + cache_offsets, mask=kv_mask, other=0.0)

        if FLOAT32_DOT:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores.to(tl.float32) * scale  # [BLOCK_M, TILE_N]
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
    out_offsets = (query_start + rows)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


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
        group = num_heads // num_kv_heads
        packed_rows = metadata.max_query_len * group
        block_m = DECODE_BLOCK_M if packed_rows <= DECODE_BLOCK_M else PREFILL_BLOCK_M
        grid = (num_requests, num_kv_heads, triton.cdiv(packed_rows, block_m))
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
            num_queries_per_kv=group,
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            TILE_N=TILE_N,
            FLOAT32_DOT=query.dtype == torch.float32 or _INTERPRETED,
        )
        return output
