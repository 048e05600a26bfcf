"""The Triton fused MoE (two grouped GEMM launches over tokens sorted by expert) against the
grouped torch path of models/moe.py on the CPU (itself held against transformers in
test_moe.py). Without a GPU it runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")

from replica_engine.kernels import triton_moe
from replica_engine.models.moe import Experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16: each path rounds at its own points, so each is held against the float32 result, the
# kernel's error (largest and mean) against the torch path's. Triton's interpreter casts to bf16 by
# truncating (up to a whole unit in the last place, always toward zero, where rounding loses at
# most half), which here makes its errors about 3x the torch path's.
BF16_ERROR_RATIO = 1.5 if DEVICE == "cuda" else 4.0


def _experts(num_experts: int, hidden: int, width: int, seed: int) -> Experts:
    experts = Experts(num_experts, hidden, width)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, hidden**-0.5, generator=gen)
        experts.down_proj.normal_(0, width**-0.5, generator=gen)
    return experts


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    return ids, torch.rand(num_tokens, top_k, generator=gen).softmax(dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 600], ids=["one_decode", "decodes", "prompt_tiles_of_64"])
def test_fused_moe_matches_the_grouped_path(dtype, num_tokens):
    experts = _experts(num_experts=8, hidden=96, width=80, seed=num_tokens)  # no multiples of a tile
    ids, weights = _routing(num_tokens, 8, top_k=2, seed=num_tokens)
    x = torch.randn(num_tokens, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    exact = experts(x.float(), ids, weights)
    expected = experts.to(dtype)(x, ids, weights)
    gate_up, down = (w.detach().to(DEVICE) for w in (experts.gate_up_proj, experts.down_proj))
    out = triton_moe.fused_moe(x.to(DEVICE), gate_up, down, ids.to(DEVICE), weights.to(DEVICE)).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        torch_error, error = ((y.float() - exact).abs() for y in (expected, out))
        assert error.max() <= BF16_ERROR_RATIO * torch_error.max()
        assert error.mean() <= BF16_ERROR_RATIO * torch_error.mean()


def test_experts_held_by_another_worker_add_nothing():
    """Expert parallelism: this worker holds experts 4-7 of 8; local ids outside 0-3 are skipped."""
    experts = _experts(num_experts=8, hidden=64, width=64, seed=3)
    ids, weights = _routing(9, 8, top_k=3, seed=3)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    expected = experts(x, ids, weights)
    held = _experts(num_experts=8, hidden=64, width=64, seed=3)
    held.gate_up_proj, held.down_proj = (
        torch.nn.Parameter(w[4:]) for w in (held.gate_up_proj, held.down_proj)
    )
    held.num_experts, held.first = 4, 4
    partial_cpu = held(x, ids, weights)
    gate_up, down = (w.detach().to(DEVICE) for w in (held.gate_up_proj, held.down_proj))
    partial = triton_moe.fused_moe(x.to(DEVICE), gate_up, down, (ids - 4).to(DEVICE), weights.to(DEVICE))
    torch.testing.assert_close(partial.cpu(), partial_cpu, atol=1e-5, rtol=1e-5)
    only_low = _experts(num_experts=8, hidden=64, width=64, seed=3)
    only_low.gate_up_proj, only_low.down_proj = (
        torch.nn.Parameter(w[:4]) for w in (only_low.gate_up_proj, only_low.down_proj)
    )
    only_low.num_experts = 4
    torch.testing.assert_close(partial_cpu + only_low(x, ids, weights), expected, atol=1e-5, rtol=1e-5)


def test_alignment_pads_each_expert_to_a_tile_and_marks_the_unused_blocks():
    ids = torch.tensor([[2, 0], [2, 5], [0, 2]])  # expert 5 is another worker's (4 held here)
    sorted_rows, block_expert = triton_moe.align_by_expert(ids, num_experts=4, tile=4)
    blocks = sorted_rows.view(-1, 4)
    assert blocks[0].tolist() == [1, 4, 6, 6] and block_expert[0] == 0  # (token, slot) = row // 2, row % 2
    assert blocks[1].tolist() == [0, 2, 5, 6] and block_expert[1] == 2
    assert (block_expert[2:] >= 4).all()  # the other worker's row, and blocks past the used ones
