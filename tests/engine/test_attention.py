"""The torch reference backend against a dense, unpaged attention computed from scratch."""

import math

import pytest
import torch

from harness.paged_batches import paged_batch
from replica_engine.attention import get_backend


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
    # (cached tokens, new tokens): a fresh prompt, a chunk after a cached prefix, two decodes.
    shapes = [(0, 7), (9, 5), (12, 1), (3, 1)]
    batch = paged_batch(shapes, heads, kv_heads, head_dim, block_size=4, seed=heads * 100 + kv_heads)
    meta, k_cache, v_cache = batch.metadata, batch.k_cache, batch.v_cache
    new_k, new_v = batch.new_k, batch.new_v
    scale = head_dim**-0.5
    out = get_backend("torch").forward(batch.query, new_k, new_v, k_cache, v_cache, meta, scale)
    expected = torch.cat(
        [
            _dense_attention(q, k, v, scale)
            for q, k, v in zip(batch.queries, batch.full_k, batch.full_v, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The new tokens landed in their cache slots.
    torch.testing.assert_close(k_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping], new_k)
