"""Our CPU kernels (replica_engine/kernels/*.cpp, built on first use) against torch: the linear
layer over packed weights, paged decode and prompt-chunk attention, and the fused RMSNorm (with the residual
add), SiLU-mul and rotary, in float32 and bfloat16; and the fallback to torch's ops where the
kernels cannot be had."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from harness.paged_batches import paged_batch
from replica_engine import EngineConfig
from replica_engine.attention import get_backend
from replica_engine.kernels import cpu as cpu_kernels

ops = cpu_kernels.cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the CPU kernels need AVX-512 and a C++ compiler")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 8, 9, 16, 17, 64, 257])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (33, 578), (5, 40), (576, 1536)])
def test_packed_linear_matches_torch(dtype, num_rows, out_features, in_features):
    generator = torch.Generator().manual_seed(num_rows * 1000 + in_features)
    x = torch.randn(num_rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    expected = F.linear(x.float(), weight.float())
    packed = cpu_kernels.pack_weight(weight)
    assert packed is not None and packed.out_features == out_features
    out = cpu_kernels.linear(x, packed)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(
        out.float(), expected, atol=TOLERANCE[dtype] * in_features**0.5, rtol=TOLERANCE[dtype]
    )
    out32 = cpu_kernels.linear(x, packed, float32_out=True)
    torch.testing.assert_close(out32, expected, atol=1e-3 * in_features**0.5, rtol=1e-4)


def test_what_cannot_be_packed_stays_with_torch():
    assert cpu_kernels.pack_weight(torch.randn(8, 17, dtype=torch.bfloat16)) is None  # odd K: no k pairs
    assert cpu_kernels.pack_weight(torch.randn(8, 16, dtype=torch.float16)) is None
    x, weight = torch.randn(3, 17), torch.randn(8, 17)
    packed = cpu_kernels.pack_weight(weight)  # float32 packs any K
    assert packed is not None
    torch.testing.assert_close(cpu_kernels.linear(x, packed), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu_kernels.linear(x, weight), F.linear(x, weight))  # unpacked: torch's


def test_a_loaded_model_runs_on_packed_weights(exact_llm):
    """Loading on the CPU packs every linear layer (its weight is gone: one copy in memory) and
    the tied embeddings get a packed copy for the logits."""
    from replica_engine.models.layers import Linear

    model = exact_llm.engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight is None for m in linears)
    assert model.tie_word_embeddings and model.packed_embeddings is not None
    hidden = torch.randn(5, model.config.hidden_size)
    embeddings = model.model.embed_tokens.weight
    torch.testing.assert_close(
        model.compute_logits(hidden), F.linear(hidden, embeddings), atol=1e-3, rtol=1e-4
    )


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm, op by op."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


# One unit of the dtype's last place: the kernels round once where torch's ops round each step.
ROUNDING = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 5, 40])
def test_rms_norm_and_its_fused_residual_add_match_torch(dtype, num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    x, residual = (torch.randn(num_rows, 576, generator=generator).to(dtype) for _ in range(2))
    weight = torch.rand(576, generator=generator).to(dtype) + 0.5
    expected_sum = residual + x
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5, None), _torch_rms_norm(x, weight, 1e-5))
    out = ops.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(residual, expected_sum)  # updated in place, rounded as torch's add rounds
    atol = ROUNDING[dtype] * 4
    torch.testing.assert_close(
        out, _torch_rms_norm(expected_sum, weight, 1e-5), atol=atol, rtol=ROUNDING[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, 40])
def test_silu_mul_matches_torch(dtype, num_rows):
    gate_up = (torch.randn(num_rows, 2 * 1536, generator=torch.Generator().manual_seed(num_rows)) * 4).to(
        dtype
    )
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(
        ops.silu_mul(gate_up), expected, atol=ROUNDING[dtype] * 8, rtol=ROUNDING[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_matches_the_torch_rotation_on_strided_views(dtype):
    from replica_engine.models.rotary import _rotate_half

    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, (9 + 3 + 3) * 64, generator=generator).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(7, 9, 64), k.view(7, 3, 64)  # strided rows: views of the fused projection
    angles = torch.rand(7, 1, 32, generator=generator) * 6
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    expected = [t.float() * cos.float() + _rotate_half(t.float()) * sin.float() for t in (q, k)]
    assert cpu_kernels.rotary_(q, k, cos, sin)
    for rotated, want in zip((q, k), expected, strict=True):
        torch.testing.assert_close(rotated.float(), want, atol=ROUNDING[dtype] * 4, rtol=ROUNDING[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_answers_as_the_rotation_then_the_backends_write(dtype):
    """One call a layer on a CPU (pointwise.rotary_store_): q rotated in place, k rotated into its
    tokens' cache slots and v beside it; bit for bit rotary_ then the backend's write_kv."""
    from replica_engine.attention.base import AttentionBackend
    from replica_engine.kernels import pointwise

    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (9 + 3 + 3) * 64, generator=generator).to(dtype)
    angles = torch.rand(5, 1, 32, generator=generator) * 6
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.tensor([3, 17, 18, 40, 63])  # across blocks of 16, one left to the end of the pool
    caches = [torch.randn(4, 16, 3, 64, generator=generator).to(dtype) for _ in range(2)]
    want_caches = [c.clone() for c in caches]

    def views(rows: torch.Tensor) -> list[torch.Tensor]:
        q, k, v = rows.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided: the fused projection's
        return [q.view(5, 9, 64), k.view(5, 3, 64), v.view(5, 3, 64)]

    q, k, v = views(qkv.clone())
    assert cpu_kernels.rotary_(q, k, cos, sin)
    AttentionBackend.write_kv(k, v, *want_caches, slots)
    fused_q, fused_k, fused_v = views(qkv)
    assert pointwise.rotary_store_(fused_q, fused_k, fused_v, (cos, sin), tuple(caches), slots)
    assert torch.equal(fused_q, q)
    for cache, want in zip(caches, want_caches, strict=True):
        assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="slot"):  # past the pool: refused, nothing written out of it
        cpu_kernels.rotary_store_(
            fused_q, fused_k, fused_v, cos, sin, *caches, torch.tensor([0, 1, 2, 3, 64])
        )


# (cached tokens, new tokens) per request.
BATCHES = {
    # Decode rows with no context yet, part of a block, exactly one block, several blocks, next to
    # a prompt chunk.
    "decodes": lambda block_size: [(0, 1), (5, 1), (block_size - 1, 1), (40, 1), (133, 1), (9, 7)],
    # One request decoding alone: its KV heads are split across the threads.
    "one decode": lambda block_size: [(3 * block_size + 5, 1)],
    # Fresh prompts shorter than, equal to and longer than a 16-row tile, chunks after a cached
    # prefix (tiles that start mid-block and keys far before them), and decode rows beside them.
    "prompts": lambda block_size: [(0, 2), (0, 16), (0, 37), (5, 1), (50, 23), (64, 16), (3, 100), (130, 1)],
}


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 32), (8, 1, 32, 16), (4, 2, 80, 16)],
)
def test_paged_attention_matches_the_reference(batch_name, dtype, heads, kv_heads, head_dim, block_size):
    shapes = BATCHES[batch_name](block_size)
    batch = paged_batch(shapes, heads, kv_heads, head_dim, block_size, seed=heads * head_dim, dtype=dtype)
    assert_cpu_attention_matches_the_reference(batch, head_dim, dtype)


def assert_cpu_attention_matches_the_reference(batch, head_dim: int, dtype: torch.dtype) -> None:
    """The CPU backend's attention of a paged batch, against the torch reference's."""
    args = (batch.query, batch.new_k, batch.new_v)
    scale = head_dim**-0.5
    caches = batch.k_cache.clone(), batch.v_cache.clone()
    expected = get_backend("torch").forward(*args, *caches, batch.metadata, scale)
    out = get_backend("cpu").forward(*args, batch.k_cache, batch.v_cache, batch.metadata, scale)
    atol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 32), (4, 2, 80)])
@pytest.mark.parametrize("shapes", [[(5 * 128 + 37, 1)], [(300, 1), (7, 1)], [(129, 1), (2000, 1)]])
def test_few_long_decodes_split_their_keys_and_match_the_reference(dtype, heads, kv_heads, head_dim, shapes):
    """Fewer decodes than twice the threads' KV-head tasks: each KV head's keys are split across
    the threads and the splits merged (4 threads asked for, whatever the machine has)."""
    batch = paged_batch(shapes, heads, kv_heads, head_dim, 16, seed=len(shapes) * head_dim, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert_cpu_attention_matches_the_reference(batch, head_dim, dtype)
    finally:
        torch.set_num_threads(threads)


def test_without_the_kernels_everything_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "cpu_ops", lambda: None)
    monkeypatch.setattr("replica_engine.config.cpu_ops", lambda: None)
    x, weight = torch.randn(2, 16), torch.randn(8, 16)
    assert cpu_kernels.pack_weight(weight) is None  # a loaded model keeps its weights for torch
    torch.testing.assert_close(cpu_kernels.linear(x, weight), F.linear(x, weight))
    residual, norm_weight = torch.randn(2, 16), torch.rand(16)
    expected_sum = residual + x
    normed, summed = cpu_kernels.rms_norm(x, norm_weight, 1e-5, residual)
    assert summed is residual and torch.equal(summed, expected_sum)
    torch.testing.assert_close(normed, _torch_rms_norm(expected_sum, norm_weight, 1e-5))
    gate_up = torch.randn(2, 64)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), F.silu(gate_up[:, :32]) * gate_up[:, 32:])
    q = torch.randn(2, 1, 64)
    assert not cpu_kernels.rotary_(q, q, torch.ones(2, 1, 64), torch.zeros(2, 1, 64))
    from transformers import LlamaConfig

    config = EngineConfig().resolve(LlamaConfig(max_position_embeddings=64))
    assert config.attention_backend == "torch"


def test_a_lock_left_by_a_killed_build_does_not_hold_up_the_next_load():
    """torch's build lock is a file: a replica killed while it built the kernels leaves it behind.
    The next load must build (or load) anyway, not wait on it forever."""
    (cpu_kernels.build_directory() / "lock").touch()  # as a killed build leaves it
    loaded: list[object] = []
    loader = threading.Thread(target=lambda: loaded.append(cpu_kernels.cpu_ops.__wrapped__()), daemon=True)
    loader.start()
    loader.join(timeout=600)  # a hang detector: loading a built module takes well under a second
    assert loaded and loaded[0] is not None
