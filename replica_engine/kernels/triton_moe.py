"""A GPU's mixture-of-experts layer in two Triton launches of one grouped GEMM kernel, over the
tokens sorted by expert and padded per expert to the kernel's row tile (the layout of vLLM's
`moe_align_block_size`, built here from torch ops):

1. each (token, slot) row of its expert's [2I, H] gate|up weight -> [T*k, 2I];
2. silu(gate) * up (triton_pointwise), then each row through its expert's [H, I] down weight,
   times its routing weight -> [T*k, H]; the k rows of a token are summed.

A program takes one BLOCK_M run of rows, all of one expert, and reads only that expert's
weights: a decode step reads the experts its batch touches. The alignment sizes its buffers by
the most blocks T*k rows can need, never by their count on the host, so a step needs no sync
(and can be captured in a CUDA graph); tiles past the used ones stop at once. Experts held by
another worker (expert parallelism: ids outside [0, E)) get no rows here.

On CPU it runs under TRITON_INTERPRET=1, where the tests check it against the grouped torch
path (models/moe.py)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from replica_engine.kernels import triton_pointwise

BLOCK_N = 64
BLOCK_K = 64
# As triton_paged: float32 at full precision (not TF32); the interpreter multiplies bf16 tiles
# as float32 (numpy has no bf16), the exact products a GPU's bf16 dot sums in float32.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["num_rows"])  # a step's rows: no compile per new "divisible by 16"
def _grouped_gemm_kernel(
    a_ptr,  # [rows of A, K]: the tokens (pass 1, each row once per slot) or [T*k, K] (pass 2)
    w_ptr,  # [E, N, K]
    out_ptr,  # [T*k, N]
    sorted_ptr,  # [padded rows]: each a (token, slot) index t*k + s, or num_rows (padding)
    block_expert_ptr,  # [blocks]: each block's expert; >= num_experts past the used blocks
    weights_ptr,  # [T*k] routing weights (pass 2)
    num_rows, num_experts, N, K, stride_a, stride_we, stride_wn, stride_out,
    ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr, FULL_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    ids = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_rows
    a_rows = ids // ROWS_PER_A
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )
        if FULL_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if MUL_WEIGHT:
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # the down projection rounds first
        acc *= tl.load(weights_ptr + ids, mask=valid, other=0.0)[:, None]
    tl.store(
        out_ptr + ids[:, None] * stride_out + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & (cols[None, :] < N),
    )


def block_m(num_rows: int) -> int:
    """Rows per tile: tl.dot's least for decode-sized batches, more for prompts."""
    return 16 if num_rows <= 1024 else 64


def align_by_expert(
    local_ids: torch.Tensor, num_experts: int, tile: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted rows, each block's expert): the (token, slot) indices grouped by expert, each
    expert's run padded with `T*k` to a multiple of `tile`; ids outside [0, E) go to a last
    bucket whose blocks (and those past the used ones) have expert >= E. Torch ops only, no sync."""
    flat = local_ids.flatten()
    num_rows, device = flat.numel(), flat.device
    buckets = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, buckets, torch.ones_like(buckets))
    padded = (counts + tile - 1) // tile * tile
    starts, padded_starts = counts.cumsum(0) - counts, padded.cumsum(0) - padded
    order = buckets.argsort(stable=True)
    by_expert = buckets[order]
    rank = torch.arange(num_rows, device=device) - starts[by_expert]
    max_blocks = num_rows // tile + num_experts + 1  # each bucket wastes under one tile
    sorted_rows = torch.full((max_blocks * tile,), num_rows, dtype=torch.long, device=device)
    sorted_rows[padded_starts[by_expert] + rank] = order
    block_starts = torch.arange(max_blocks, device=device) * tile
    block_expert = torch.searchsorted(padded.cumsum(0), block_starts, right=True)
    return sorted_rows, block_expert


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_rows: torch.Tensor,
    block_expert: torch.Tensor,
    num_rows: int,
    rows_per_a: int,
    tile: int,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    num_experts, n, k = w.shape
    out = torch.zeros((num_rows, n), dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_rows, block_expert, weights if weights is not None else out,
        num_rows, num_experts, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_A=rows_per_a, MUL_WEIGHT=weights is not None,
        FULL_FP32=a.dtype == torch.float32 or _INTERPRETED,
        BLOCK_M=tile, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    local_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """As models.moe.Experts: x [T, H], gate_up [E, 2I, H], down [E, H, I], each token's k
    expert ids (local: this worker's first expert is 0) and float32 weights [T, k] -> [T, H]."""
    num_tokens, top_k = local_ids.shape
    num_rows = num_tokens * top_k
    tile = block_m(num_rows)
    sorted_rows, block_expert = align_by_expert(local_ids, gate_up.shape[0], tile)
    x = x.contiguous()
    gate_up_rows = _grouped_gemm(x, gate_up, sorted_rows, block_expert, num_rows, top_k, tile)
    hidden = triton_pointwise.silu_mul(gate_up_rows)
    flat_weights = weights.flatten().float().contiguous()
    out = _grouped_gemm(hidden, down, sorted_rows, block_expert, num_rows, 1, tile, flat_weights)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
