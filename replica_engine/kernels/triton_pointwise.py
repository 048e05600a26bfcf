"""Triton kernels for a GPU step's pointwise work, one launch each where torch's ops take
several: the residual add fused into RMSNorm, SiLU(gate) * up, and q and k rotated with the
step's K and V written into the paged cache. The H200 showed ~24 small kernels per layer around
the 4 matmuls and the attention; in a decode step (and a CUDA graph of one) those launches are
much of the time left after the weights are read.

Each rounds where torch's own ops round (to the model's dtype after every op that torch runs
in it), so the results are the torch fallback's, which is Hugging Face's arithmetic. On CPU the
tests run them under TRITON_INTERPRET=1 against that fallback."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, eps, dim,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=valid, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # the sum in float32, as torch's
        tl.store(residual_ptr + row * stride_r + cols, x, mask=valid)
    summed = x.to(tl.float32)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(summed * summed, 0) / dim + eps)
    normed = (summed * inverse_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=valid)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """As kernels.cpu.rms_norm: (RMSNorm of x + residual, x + residual), residual updated in place."""
    num_rows, dim = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = x if residual is None else residual
    _rms_norm_kernel[(num_rows,)](
        x, summed, weight, out, x.stride(0), summed.stride(0), out.stride(0), eps, dim,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(dim),
    )  # fmt: skip
    return out, summed


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=valid, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=valid, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=valid)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    num_rows, double_width = gate_up.shape
    width = double_width // 2
    out = torch.empty((num_rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel[(num_rows, triton.cdiv(width, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=block
    )
    return out


@triton.jit
def _rotary_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_slot,
    num_q_heads, num_kv_heads, HALF: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)  # q's heads, then k's, then v's
    cols = tl.arange(0, HALF)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if head >= num_q_heads + num_kv_heads:  # a value: into its slot as it is
        kv_head = head - num_q_heads - num_kv_heads
        source = v_ptr + token * stride_vt + kv_head * stride_vh
        target = v_cache_ptr + slot * stride_slot + kv_head * (2 * HALF)
        tl.store(target + cols, tl.load(source + cols))
        tl.store(target + HALF + cols, tl.load(source + HALF + cols))
    else:  # a query (rotated in place) or a key (rotated into its slot)
        if head < num_q_heads:
            source = q_ptr + token * stride_qt + head * stride_qh
            target = source
        else:
            source = k_ptr + token * stride_kt + (head - num_q_heads) * stride_kh
            target = k_cache_ptr + slot * stride_slot + (head - num_q_heads) * (2 * HALF)
        x1 = tl.load(source + cols)
        x2 = tl.load(source + HALF + cols)
        dtype = x1.dtype
        cos1 = tl.load(cos_ptr + token * stride_ct + cols).to(tl.float32)
        cos2 = tl.load(cos_ptr + token * stride_ct + HALF + cols).to(tl.float32)
        sin1 = tl.load(sin_ptr + token * stride_ct + cols).to(tl.float32)
        sin2 = tl.load(sin_ptr + token * stride_ct + HALF + cols).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded as torch rounds it
        first = (a * cos1).to(dtype).to(tl.float32) + (-b * sin1).to(dtype).to(tl.float32)
        second = (b * cos2).to(dtype).to(tl.float32) + (a * sin2).to(dtype).to(tl.float32)
        tl.store(target + cols, first.to(dtype))
        tl.store(target + HALF + cols, second.to(dtype))


def rotary_store_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate q [T, H, d] in place and k [T, KVH, d] into the cache, and store v there, by cos
    and sin ([T, 1, d], contiguous): each token's K/V at its slot of the contiguous caches
    ([num_blocks, block_size, KVH, d]). One launch where rotating, then writing K and V,
    took three; k itself is left as it was."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _rotary_store_kernel[(num_tokens, num_q_heads + 2 * num_kv_heads)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(1), num_q_heads, num_kv_heads, HALF=head_dim // 2,
    )  # fmt: skip
