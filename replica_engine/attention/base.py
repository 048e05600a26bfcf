"""The one interface every attention backend implements, and the metadata it reads."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from replica_engine.device_transfer import move_to


@dataclass
class DecodeRows:
    """The batch's one-token rows (decodes), picked out once per step for backends that attend to
    them together (not once per layer): where they sit in the flat batch, their block tables and
    their context lengths."""

    token_index: torch.Tensor  # [R] int64: row of each in the flat batch
    block_tables: torch.Tensor  # [R, max_blocks] int32
    seq_lens: torch.Tensor  # [R] int32
    max_seq_len: int

    @classmethod
    def pick(
        cls,
        cu_seqlens_q: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens_kv: torch.Tensor,
        query_lens: list[int],
    ) -> DecodeRows | None:
        rows = [i for i, n in enumerate(query_lens) if n == 1]
        if not rows:
            return None
        index = torch.tensor(rows, device=cu_seqlens_q.device)
        seq_lens = seq_lens_kv[index]
        return cls(cu_seqlens_q[index].long(), block_tables[index], seq_lens, int(seq_lens.max()))

    def to(self, device: torch.device) -> DecodeRows:
        """On `device`, copied from pinned memory: nothing waits for the device's queue."""
        return DecodeRows(
            move_to(self.token_index, device),
            move_to(self.block_tables, device),
            move_to(self.seq_lens, device),
            self.max_seq_len,
        )


@dataclass
class AttentionMetadata:
    """Describes one flat varlen batch: request i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1],
    and its keys are the first seq_lens_kv[i] tokens of its blocks (cached context + this step's)."""

    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32
    seq_lens_kv: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with the null block (0)
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V goes to
    max_query_len: int
    # Host copies for backends that loop in Python (the reference); never read on the GPU path.
    query_lens_cpu: list[int]
    seq_lens_kv_cpu: list[int]
    decode: DecodeRows | None  # None when the batch has no one-token rows

    @functools.cached_property
    def kernel_args(self) -> tuple:
        """What the CPU kernels read (cpu_attention.h's PagedAttentionArgs), once a step, not once
        a layer."""
        decode = self.decode
        rows = None if decode is None else (decode.token_index, decode.block_tables, decode.seq_lens)
        return (self.block_tables, self.cu_seqlens_q, self.seq_lens_kv, self.max_query_len, rows)


class NullBlockWriteError(RuntimeError):
    """A real token's K/V was about to land in the null block: its block table was incomplete."""


class AttentionBackend(ABC):
    name: str

    @staticmethod
    def write_kv(
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store this step's keys/values ([T, kv_heads, head_dim]) into their cache slots (none
        in the null block: build_flat_batch checks that once per step)."""
        num_kv_heads, head_dim = key.shape[1:]
        k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = key
        v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = value

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """query [T, heads, head_dim], key/value [T, kv_heads, head_dim] for this step's tokens;
        caches [num_blocks, block_size, kv_heads, head_dim]. Writes the new K/V into the cache,
        then attends each query to its request's cached context with a bottom-right causal mask.
        Returns [T, heads, head_dim]."""
        self.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        return self.attend(query, k_cache, v_cache, metadata, scale)

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of this step's queries over the cache, which already holds their own K/V."""
