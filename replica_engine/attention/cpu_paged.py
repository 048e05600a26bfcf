"""The CPU backend: the reference's prompt-chunk path, with decode rows attended by a compiled
kernel that reads each request's K/V blocks where they lie in the paged cache (an online
softmax block by block) instead of gathering them into a padded copy every layer."""

from __future__ import annotations

import torch

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
