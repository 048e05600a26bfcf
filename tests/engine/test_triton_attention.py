"""The Triton paged-attention backend against the torch reference, on random paged batches.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported), at small shapes; with one, natively, in bfloat16 as well."""

from __future__ import annotations

import zlib

import pytest
import torch

# conftest sets TRITON_INTERPRET=1 on a machine without a GPU, before anything imports triton.
triton = pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")

from harness.paged_batches import paged_batch  # noqa: E402
from replica_engine.attention import get_backend  # noqa: E402
from replica_engine.attention.triton_paged import TritonAttention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {
    "decode": [(5, 1), (40, 1), (17, 1)],
    "prefill": [(0, 21), (0, 3), (0, 33)],
    "mixed": [(0, 19), (30, 1), (12, 9), (2, 1)],
    "chunks after cached prefixes": [(150, 16), (0, 1), (1, 33)],  # 1 + 16: a tile ends past a block
}


@pytest.mark.parametrize("batch_kind", list(SHAPES))
# GQA ratios 1, 4, 3 (SmolLM2's) and 8
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 1), (6, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_matches_the_reference(batch_kind: str, heads: int, kv_heads: int, head_dim: int):
    # Different inputs per case, the same on every run (str hashes are salted per process).
    seed = zlib.crc32(repr((batch_kind, heads, kv_heads, head_dim)).encode())
    print(f"seed {seed}")
    for block_size in (16, 32):
        batch = paged_batch(SHAPES[batch_kind], heads, kv_heads, head_dim, block_size, seed, device=DEVICE)
        args = (batch.query, batch.new_k, batch.new_v)
        scale = head_dim**-0.5
        expected_cache = batch.k_cache.clone(), batch.v_cache.clone()
        expected = get_backend("torch").forward(*args, *expected_cache, batch.metadata, scale)
        out = TritonAttention().forward(*args, batch.k_cache, batch.v_cache, batch.metadata, scale)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5, msg=lambda m: f"seed {seed}: {m}")
        torch.testing.assert_close(batch.k_cache, expected_cache[0])


def test_block_size_must_be_a_multiple_of_16():
    batch = paged_batch([(0, 4)], 2, 2, 64, block_size=8, seed=0, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 16"):
        TritonAttention().forward(
            batch.query, batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, batch.metadata, 0.125
        )


def test_the_engine_on_the_triton_backend_answers_as_on_the_reference(llm):
    """The real SmolLM2 end to end with the Triton kernel (interpreted on CPU): same greedy tokens."""
    from replica_engine import LLM, SamplingParams

    triton_llm = LLM(attention_backend="triton", kv_cache_bytes=16 << 20, device=DEVICE, dtype="float32")
    params = SamplingParams(max_tokens=4, temperature=0)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    assert [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in llm.generate(prompts, params)
    ]
