"""The CPU backend: compiled kernels that read each request's K/V blocks where they lie in the
paged cache instead of gathering them into a copy every layer: one for decode rows, one for
prompt chunks (tiled as flash attention is), both from one call a layer (cpu_decode_attention.cpp's
paged_attention, which the fused decoder layer calls too)."""

from __future__ import annotations

import torch

from replica_engine.attention.base import AttentionBackend, AttentionMetadata
from replica_engine.kernels.cpu import cpu_ops


class CPUPagedAttention(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        ops = cpu_ops()
        if ops is None:
            raise RuntimeError("the CPU kernels are not available on this machine (see the log)")
        self._ops = ops

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return self._ops.paged_attention(query, k_cache, v_cache, metadata.kernel_args, scale)
