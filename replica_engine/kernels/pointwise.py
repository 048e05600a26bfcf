"""The pointwise ops of a model step on the kernels of the device they run on: Triton's on a
GPU (triton_pointwise.py), the CPU's own elsewhere (cpu.py, which falls back to torch's ops
where its kernels do not apply). Triton is imported only on a GPU: a CPU install lacks it."""

from __future__ import annotations

import torch

from replica_engine.kernels import cpu as cpu_kernels


def _rows(*tensors: torch.Tensor) -> bool:
    """On a GPU, [rows, dim] with unit column stride: the Triton kernels' layout."""
    return all(t.is_cuda and t.dim() == 2 and t.stride(-1) == 1 for t in tensors)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of x + residual, x + residual), or of x alone when there is no residual: the
    residual stream's add fused into the norm (the residual is updated in place)."""
    if _rows(x) and (residual is None or _rows(residual)):
        from replica_engine.kernels import triton_pointwise

        return triton_pointwise.rms_norm(x, weight, eps, residual)
    return cpu_kernels.rms_norm(x, weight, eps, residual)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    if _rows(gate_up):
        from replica_engine.kernels import triton_pointwise

        return triton_pointwise.silu_mul(gate_up)
    return cpu_kernels.silu_mul(gate_up)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate q [T, H, d] and k [T, KVH, d] in place by cos and sin ([T, 1, d]) where the CPU's
    kernel applies; False (nothing done) where it does not (a GPU's rotation is rotary_store_'s)."""
    return cpu_kernels.rotary_(q, k, cos, sin)


def rotary_store_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
) -> bool:
    """q rotated in place, k rotated into its tokens' cache slots and v stored beside it, in one
    launch on a GPU and one call on a CPU; False (nothing done) where neither kernel applies
    (then: rotary_, and the backend's write_kv)."""
    if not q.is_cuda:
        return cpu_kernels.rotary_store_(q, k, v, *cos_sin, *kv_cache, slot_mapping)
    half = q.shape[-1] // 2
    applies = (
        q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and half & (half - 1) == 0
        and all(t.is_contiguous() for t in (*cos_sin, *kv_cache))
    )
    if applies:
        from replica_engine.kernels import triton_pointwise

        triton_pointwise.rotary_store_(q, k, v, *cos_sin, *kv_cache, slot_mapping)
    return applies
