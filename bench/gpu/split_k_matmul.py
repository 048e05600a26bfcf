"""A candidate for a decode step's matmuls, measured beside the matmul library's in bench.gpu's
kernels part: a Triton split-K matmul for a few rows. At a decode batch's rows a matmul reads its
whole weight for little arithmetic, so what counts is keeping the HBM busy: the weight's columns
are split over programs and, where that leaves too few of them to fill the device, its K range
too, each program adding its partial product into a float32 output. The engine does not use it:
it is here so that one device run says, shape by shape, whether it reads the weight faster than
the library does (the decode goal's MISS is most of all the matmuls', bench/gpu/gpu_kernels.py).

On a CPU it runs under TRITON_INTERPRET=1 (bf16 tiles multiplied as float32 there, as
triton_paged does)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_K = 128
MAX_ROWS = 64  # a decode batch's rows (BLOCK_M: the rows, rounded up to a power of two)


@dataclass(frozen=True)
class SplitK:
    block_n: int  # output columns a program takes
    split_k: int  # programs sharing one column tile's K range

    @property
    def name(self) -> str:
        return f"n{self.block_n}/k{self.split_k}"


CONFIGS = tuple(SplitK(n, k) for n in (64, 128) for k in (1, 4, 8))


@triton.jit
def _split_k_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLOAT32_DOT: tl.constexpr,
):  # fmt: skip
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_range = ks < k_end
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=(rows < M)[:, None] & in_range[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + ks[None, :],
            mask=(cols < N)[:, None] & in_range[None, :],
            other=0.0,
        )
        if FLOAT32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.atomic_add(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=mask)


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, config: SplitK) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in x's dtype, as F.linear; M of at most MAX_ROWS rows."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    assert rows <= MAX_ROWS and x.stride(1) == weight.stride(1) == 1, "a few rows of unit column stride"
    out = torch.zeros((rows, out_features), dtype=torch.float32, device=x.device)
    # each split's range a whole number of BLOCK_K tiles, so no tile straddles two splits
    k_per_split = triton.cdiv(triton.cdiv(in_features, config.split_k), BLOCK_K) * BLOCK_K
    grid = (triton.cdiv(out_features, config.block_n), triton.cdiv(in_features, k_per_split))
    _split_k_kernel[grid](
        x, weight, out, rows, out_features, in_features, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0), BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=config.block_n, BLOCK_K=BLOCK_K, FLOAT32_DOT=x.dtype == torch.float32 or _INTERPRETED,
    )  # fmt: skip
    return out.to(x.dtype)
