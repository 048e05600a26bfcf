"""The Triton pointwise kernels of a GPU step against transformers' own Llama modules (the
oracle), within one rounding of the dtype. Without a GPU they run in Triton's interpreter
(conftest sets TRITON_INTERPRET=1 before anything imports triton)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from replica_engine.kernels import triton_pointwise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative: a unit in the last place. Triton's interpreter casts float32 to bfloat16 by
# truncating, not rounding to nearest, so there each of a kernel's casts may be one unit off.
ULP = {torch.float32: 1e-6, torch.bfloat16: 2**-7}
BF16_ULPS = 1 if DEVICE == "cuda" else 3


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = ULP[expected.dtype] * (BF16_ULPS if expected.dtype == torch.bfloat16 else 1)
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [576, 4096])  # SmolLM2's hidden size is no power of two
def test_rms_norm_with_and_without_the_residual_add(dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    x, residual = (torch.randn(5, dim, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    oracle = LlamaRMSNorm(dim, eps=1e-5).to(dtype).to(DEVICE)
    with torch.no_grad():
        oracle.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
    expected_sum = residual + x

    out, summed = triton_pointwise.rms_norm(x, oracle.weight, 1e-5)
    close(out, oracle(x))
    assert summed is x
    out, summed = triton_pointwise.rms_norm(x, oracle.weight, 1e-5, residual)
    assert summed is residual  # updated in place
    close(residual, expected_sum)
    close(out, oracle(expected_sum))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(3, 2 * 1536, generator=gen) * 4).to(dtype).to(DEVICE)  # 1536: two column blocks
    gate, up = gate_up.chunk(2, dim=-1)
    close(triton_pointwise.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 128)])
def test_rotary_store_rotates_q_in_place_and_k_into_the_cache_beside_v(dtype, heads, kv_heads, head_dim):
    tokens, block_size, num_blocks = 6, 4, 5
    gen = torch.Generator().manual_seed(heads)
    # q, k and v as the model has them: views of one fused projection's output
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    # transformers: [batch, heads, tokens, d] with cos/sin [batch, tokens, d]
    expected_q, expected_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    k_cache, v_cache = (
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv"
    )
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    slots = torch.tensor([4, 5, 6, 13, 19, 8], device=DEVICE)  # blocks 1, 3, 4 and 2, out of order
    untouched = [s for s in range(num_blocks * block_size) if s not in slots.tolist()]
    before_k, before_v, before_kv = k_cache.clone(), v_cache.clone(), qkv[:, heads * head_dim :].clone()

    triton_pointwise.rotary_store_(q, k, v, cos[:, None, :], sin[:, None, :], k_cache, v_cache, slots)

    close(q, expected_q[0].transpose(0, 1))
    close(k_cache.view(-1, kv_heads, head_dim)[slots], expected_k[0].transpose(0, 1))
    assert torch.equal(
        v_cache.view(-1, kv_heads, head_dim)[slots], before_kv[:, kv_heads * head_dim :].view(v.shape)
    )
    for cache, before in ((k_cache, before_k), (v_cache, before_v)):
        assert torch.equal(
            cache.view(-1, kv_heads, head_dim)[untouched], before.view(-1, kv_heads, head_dim)[untouched]
        )
    assert torch.equal(qkv[:, heads * head_dim :], before_kv)  # k and v themselves as they were
