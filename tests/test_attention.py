"""The torch reference backend against a dense, unpaged attention computed from scratch."""

import math

import pytest
import torch

from replica_engine.attention import INVALID_BLOCK_ID, AttentionMetadata, get_backend


def _dense_attention(q, k, v, scale):
    """q [q_len, H, D], k/v [kv_len, Hkv, D], causal with the queries at the end."""
    q_len, kv_len, heads = q.shape[0], k.shape[0], q.shape[1]
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(q_len)[:, None] + kv_len - q_len
    scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32), (8, 1, 64)])
def test_mixed_batch_of_prefill_chunks_and_decodes_matches_dense_attention(heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads)
    block_size, num_blocks = 4, 40
    # (cached tokens, new tokens): a fresh prompt, a chunk after a cached prefix, two decodes.
    shapes = [(0, 7), (9, 5), (12, 1), (3, 1)]
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, out-of-order blocks
    full_k, full_v, tables, slots, queries = [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
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
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(
            [0, *torch.tensor([n for _, n in shapes]).cumsum(0).tolist()], dtype=torch.int32
        ),
        seq_lens_kv=torch.tensor([c + n for c, n in shapes], dtype=torch.int32),
        block_tables=torch.tensor(
            [[*t, *[INVALID_BLOCK_ID] * (width - len(t))] for t in tables], dtype=torch.int32
        ),
        slot_mapping=torch.tensor(slots),
        max_query_len=7,
        max_seq_len_kv=14,
        query_lens_cpu=[n for _, n in shapes],
        seq_lens_kv_cpu=[c + n for c, n in shapes],
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    scale = head_dim**-0.5
    out = get_backend("torch").forward(torch.cat(queries), new_k, new_v, k_cache, v_cache, meta, scale)
    expected = torch.cat(
        [_dense_attention(q, k, v, scale) for q, k, v in zip(queries, full_k, full_v, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The new tokens landed in their cache slots.
    torch.testing.assert_close(k_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping], new_k)
