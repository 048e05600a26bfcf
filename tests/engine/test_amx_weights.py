"""AMX copies of the linear weights (EngineConfig.amx_weights): a step of many tokens multiplies
the bfloat16 copy through torch (oneDNN: AMX tiles where the CPU has them, slower paths
elsewhere, so these run on any CPU), a step of few tokens the kernels' own weight; the engine's
perplexity is the kernels' one; off by default, so a step's size never changes a token's logits;
the setting refuses what it cannot do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.quality.quantization import perplexity
from bench.text_prompts import text_prompts
from common.errors import InvalidRequestError
from common.model_source import DEFAULT_MODEL, resolve_model
from replica_engine import LLM, EngineConfig, SamplingParams
from replica_engine.kernels import cpu as cpu_kernels
from replica_engine.kernels.quantized_weight import dequantize, pack_quantized
from replica_engine.models.layers import Linear
from replica_engine.models.loader import load_config

pytestmark = pytest.mark.skipif(cpu_kernels.cpu_ops() is None, reason="the CPU kernels need AVX-512")


def _kernel_weights(n: int, k: int) -> dict[str, tuple]:
    """A quantized and a packed weight, each with the float weight it holds."""
    generator = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    d = torch.rand(n, k // 32, generator=generator) * 0.02
    quantized = pack_quantized(codes, d, -8 * d, 4, 32)
    dense = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    return {"quantized": (quantized, None), "packed": (cpu_kernels.pack_weight(dense), dense)}


@pytest.mark.parametrize("kind", ["quantized", "packed"])
def test_many_rows_take_the_bfloat16_copy_and_few_the_kernels_weight(kind):
    kernel_weight, dense = _kernel_weights(96, 576)[kind]
    tiled = cpu_kernels.tiled_weight(kernel_weight, dense)
    expected_dense = dequantize(kernel_weight).to(torch.bfloat16) if dense is None else dense
    assert torch.equal(tiled.dense, expected_dense)
    for rows in (1, 16, cpu_kernels.AMX_MIN_ROWS - 1, cpu_kernels.AMX_MIN_ROWS, 257):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        out = cpu_kernels.linear(x, tiled)
        by_kernel = cpu_kernels.linear(x, kernel_weight)
        if rows < cpu_kernels.AMX_MIN_ROWS:
            assert torch.equal(out, by_kernel), rows
        else:
            assert torch.equal(out, F.linear(x, tiled.dense)), rows
            scale = by_kernel.float().abs().max()
            assert (out.float() - by_kernel.float()).abs().max() <= 2e-2 * scale, rows
        if kind == "quantized":  # a float32 step (which it also takes) never takes the bfloat16 copy
            x32 = x.float()
            assert torch.equal(cpu_kernels.linear(x32, tiled), cpu_kernels.linear(x32, kernel_weight))


def test_the_engine_holds_both_copies_and_its_perplexity_is_the_kernels_one():
    amx = LLM(dtype="bfloat16", amx_weights=True)
    model = amx.engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.packed, cpu_kernels.TiledWeight) for m in linears)
    assert all(m.packed.dense.dtype == torch.bfloat16 and m.weight is None for m in linears)
    kernels = LLM(dtype="bfloat16", amx_weights=False)
    kernel_linears = [m for m in kernels.engine.core.runner.model.modules() if isinstance(m, Linear)]
    assert not any(isinstance(m.packed, cpu_kernels.TiledWeight) for m in kernel_linears)
    windows = text_prompts(amx.tokenizer, [256] * 4, seed=1)  # prompts of many tokens a step
    assert abs(perplexity(amx, windows) / perplexity(kernels, windows) - 1) <= 0.01


def test_off_by_default_so_a_prefix_cache_hit_answers_with_the_same_logprobs():
    """The default keeps a token's logits independent of its step: the same greedy chat, its
    prompt computed in one step of 30-odd rows and then found in the prefix cache (a few rows
    computed), gives the same logprobs to the bit. (With the copy, the first step's rows went
    through it and the cached run's through the kernels: -1.773 against -1.809 here.)"""
    assert EngineConfig().amx_weights is False
    llm = LLM(dtype="bfloat16", enable_prefix_caching=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    cold, cached = (llm.chat(messages, params)[0] for _ in range(2))
    assert cached.num_cached_tokens >= 16  # the second found the first's blocks (16 tokens each)
    assert cached.outputs[0].token_ids == cold.outputs[0].token_ids
    assert cached.outputs[0].logprobs == cold.outputs[0].logprobs


@pytest.mark.parametrize(
    "settings",
    [dict(amx_weights="yes"), dict(amx_weights=1)],
)
def test_a_non_boolean_is_refused_naming_the_setting(settings):
    with pytest.raises(InvalidRequestError, match="amx_weights"):
        EngineConfig(**settings)


def test_a_float32_model_or_a_gpu_is_refused_an_amx_copy(monkeypatch):
    model_config = load_config(resolve_model(DEFAULT_MODEL))
    with pytest.raises(InvalidRequestError, match=r"amx_weights.*float32 on a CPU"):
        EngineConfig(dtype="float32", device="cpu", amx_weights=True).resolve(model_config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolved only: no model runs
    with pytest.raises(InvalidRequestError, match=r"amx_weights.*on a GPU"):
        EngineConfig(dtype="bfloat16", device="cuda", amx_weights=True).resolve(model_config)
