"""The CPU backend: compiled kernels that read each request's K/V blocks where they lie in the
paged cache (an online softmax, 16 keys at a time) instead of gathering them into a copy every
layer: one for decode rows, one for prompt chunks (tiled as flash attention is)."""

from __future__ import annotations

import torch

from replica_engine.attention.base import AttentionMetadata
from replica_engine.attention.torch_ref import TorchAttention
from replica_engine.kernels.cpu import cpu_ops


class CPUPagedAttention(TorchAttention):
    name = "cpu"

    def __init__(self) -> None:
        ops = cpu_ops()
        if ops is None:
            raise RuntimeError("the CPU kernels are not available on this machine (see the log)")
        self._ops = ops

    def attend_decodes(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_len: int,
        scale: float,
    ) -> torch.Tensor:
        return self._ops.paged_decode_attention(
            query.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale
        )

    def attend_prompts(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        self._ops.paged_prefill_attention_(
            output,
            query.contiguous(),
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.cu_seqlens_q,
            metadata.seq_lens_kv,
            scale,
        )
