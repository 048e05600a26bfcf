"""Random paged batches for attention tests: scattered blocks, cached context, fresh per seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica_engine.attention import AttentionMetadata
from replica_engine.attention.base import DecodeRows
from replica_engine.kv_cache_manager import NULL_BLOCK_ID, blocks_for_tokens


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, heads, head_dim], this step's queries
    new_k: torch.Tensor  # [T, kv_heads, head_dim], this step's keys/values (not yet cached)
    new_v: torch.Tensor
    k_cache: torch.Tensor  # holds every request's earlier context
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    full_k: list[torch.Tensor]  # per request: all its keys/values, context + new
    full_v: list[torch.Tensor]
    queries: list[torch.Tensor]  # per request


def paged_batch(
    shapes: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> PagedBatch:
    """`shapes`: (cached tokens, new tokens) per request."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(blocks_for_tokens(c + n, block_size) for c, n in shapes) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)  # junk where unused
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    # Scattered, out-of-order blocks; never the null block, which pads the tables.
    free = [b for b in torch.randperm(num_blocks, generator=gen).tolist() if b != NULL_BLOCK_ID]
    full_k, full_v, tables, slots, queries = [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        blocks = [free.pop() for _ in range(blocks_for_tokens(total, block_size))]
        tables.append(blocks)
        k = torch.randn(total, kv_heads, head_dim, generator=gen)
        v = torch.randn(total, kv_heads, head_dim, generator=gen)
        for pos in range(cached):  # the context an earlier step wrote
            k_cache[blocks[pos // block_size], pos % block_size] = k[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v[pos]
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(new, heads, head_dim, generator=gen))
    width = max(map(len, tables))
    query_lens = [n for _, n in shapes]
    kv_lens = [c + n for c, n in shapes]
    metadata = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens_kv=torch.tensor(kv_lens, dtype=torch.int32),
        block_tables=torch.tensor(
            [[*t, *[NULL_BLOCK_ID] * (width - len(t))] for t in tables], dtype=torch.int32
        ),
        slot_mapping=torch.tensor(slots),
        max_query_len=max(query_lens),
        query_lens_cpu=query_lens,
        seq_lens_kv_cpu=kv_lens,
        decode=None,
    )

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    metadata.cu_seqlens_q, metadata.seq_lens_kv = to(metadata.cu_seqlens_q), to(metadata.seq_lens_kv)
    metadata.block_tables, metadata.slot_mapping = to(metadata.block_tables), to(metadata.slot_mapping)
    metadata.decode = DecodeRows.pick(
        metadata.cu_seqlens_q, metadata.block_tables, metadata.seq_lens_kv, query_lens
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    return PagedBatch(
        to(torch.cat(queries)),
        to(new_k),
        to(new_v),
        to(k_cache),
        to(v_cache),
        metadata,
        full_k,
        full_v,
        queries,
    )
