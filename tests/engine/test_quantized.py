"""Weights kept quantized (issue 39): the kernel against dequantize-then-matmul, GGUF's blocks
against gguf-py's own dequantization and the embedded file's converted weights, the engine's
outputs and perplexity against the dequantized path, and the settings that refuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize
from safetensors import safe_open

from bench.quality.quantization import GREEDY_PARAMS, divergences, perplexity
from bench.text_prompts import text_prompts
from common.errors import InvalidRequestError
from common.model_source import embedded_gguf_path
from harness.hf_reference import EXACTNESS_PROMPTS
from replica_engine import LLM, EngineConfig, SamplingParams
from replica_engine.kernels import cpu as cpu_kernels
from replica_engine.kernels.quantized_weight import (
    FORMATS,
    QuantizedWeight,
    dequantize,
    dequantize_rows,
    pack_quantized,
    quantize_int8,
)
from replica_engine.models.gguf_blocks import DECODERS
from replica_engine.models.gguf_file import read_metadata, read_tensors
from replica_engine.models.gguf_weights import rotary_rows

pytestmark = pytest.mark.skipif(cpu_kernels.cpu_ops() is None, reason="the CPU kernels need AVX-512")

# (N, K): SmolLM2's fused qkv, o_proj, gate_up, down_proj and logits; then odd sizes.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (37, 64), (1, 32), (17, 96)]
ROWS = [1, 2, 3, 4, 5, 8, 33]


def _random_weight(bits: int, group: int, n: int, k: int, seed: int) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=generator)
    d = torch.rand(n, k // group, generator=generator) * 0.02
    m = -torch.rand(n, k // group, generator=generator) * 0.1
    return pack_quantized(codes, d, m, bits, group)


def _int16_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: int16 per 32 values, one scale each (max |x| / 32767)."""
    groups = x.float().view(x.shape[0], -1, 32)
    scale = groups.abs().amax(-1, keepdim=True) / 32767
    return (torch.where(scale > 0, groups / scale, 0).round() * scale).view(x.shape)


@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_dequantize_then_matmul(bits, group, n, k):
    weight = _random_weight(bits, group, n, k, seed=n + k)
    dense = dequantize(weight)
    for rows in ROWS if n < 10000 else [1, 8]:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        expected = _int16_rows(x) @ dense.T
        scale = expected.abs().max()
        out = cpu_kernels.linear(x, weight)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        # an x exactly between two int16 codes may round either way: one code of difference
        assert (out - expected).abs().max() <= 5e-5 * scale, (rows, "float32")
        out_bf16 = cpu_kernels.linear(x.bfloat16(), weight)
        assert out_bf16.dtype == torch.bfloat16
        expected_bf16 = _int16_rows(x.bfloat16()) @ dense.T
        assert (out_bf16.float() - expected_bf16).abs().max() <= 1e-2 * scale, (rows, "bfloat16")
        # against x itself, the int16 rounding of the activations is all that is lost
        assert (out - x @ dense.T).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("n,k", [(49152, 576), (37, 64), (17, 96)])
def test_embedding_rows_are_the_dequantized_rows_bit_for_bit(bits, group, n, k):
    weight = _random_weight(bits, group, n, k, seed=n * k)
    ids = torch.tensor([0, n - 1, n // 2, 15 % n, 16 % n, n - 1])  # both block edges, repeats
    for dtype in (torch.float32, torch.bfloat16):
        expected = dequantize_rows(weight, ids).to(dtype)
        for typed_ids in (ids, ids.int(), ids.view(2, 3)):
            out = cpu_kernels.embedding_rows(weight, typed_ids, dtype)
            assert out.dtype == dtype and torch.equal(out, expected), (dtype, typed_ids.dtype)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.embedding_rows(weight, torch.tensor([n]), torch.float32)


def test_without_the_kernels_a_quantized_weight_is_dequantized_for_torch(monkeypatch):
    weight = _random_weight(4, 32, 40, 64, seed=1)
    x = torch.randn(3, 64)
    monkeypatch.setattr(cpu_kernels, "cpu_ops", lambda: None)
    torch.testing.assert_close(cpu_kernels.linear(x, weight), x @ dequantize(weight).T)


def test_int8_keeps_each_column_within_half_a_step():
    w = torch.randn(50, 96) * torch.logspace(-3, 1, 50)[:, None]  # columns of very different size
    quantized = quantize_int8(w)
    step = (w.abs().amax(dim=1, keepdim=True) / 127).half().float()
    assert ((dequantize(quantized) - w).abs() <= step / 2 + 1e-7).all()


# Bytes per block and the offsets of the block's float16 scales (random bytes there are set to
# real numbers: a random float16 may be inf or NaN).
BLOCKS = {
    "Q4_0": (18, [0]),
    "Q4_1": (20, [0, 2]),
    "Q8_0": (34, [0]),
    "Q4_K": (144, [0, 2]),
    "Q6_K": (210, [208]),
}


@pytest.mark.parametrize("type_name", list(BLOCKS))
def test_gguf_blocks_decode_as_gguf_py_dequantizes_them(type_name):
    block_bytes, half_offsets = BLOCKS[type_name]
    per_block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    rng = np.random.default_rng(0)
    n, k = 24, 2 * 256
    raw = rng.integers(0, 256, (n, k // per_block, block_bytes), dtype=np.uint8)
    for offset in half_offsets:
        halves = (rng.standard_normal((n, k // per_block)) * 0.01).astype(np.float16)
        raw[..., offset : offset + 2] = halves[..., None].view(np.uint8)
    data = raw.reshape(n, -1)
    expected = torch.from_numpy(gguf_dequantize(data, GGMLQuantizationType[type_name]))
    block = DECODERS[type_name](torch.from_numpy(data))
    values = block.codes.float() * block.d.repeat_interleave(block.group, 1)
    values += block.m.repeat_interleave(block.group, 1)
    assert torch.equal(values, expected)  # read exactly as the file means them
    # Packed: the K-quants' sub-block scales (d * a 6- or 8-bit scale) are rounded to float16.
    exact = type_name in ("Q4_0", "Q4_1", "Q8_0")
    tolerance = 0 if exact else 1e-3 * expected.abs().max()
    assert (dequantize(block.packed()) - expected).abs().max() <= tolerance


def test_our_gguf_index_finds_every_tensor_where_gguf_py_does():
    ours = read_tensors(embedded_gguf_path())
    theirs = GGUFReader(str(embedded_gguf_path())).tensors
    assert len(ours) == len(theirs) == 272
    for tensor in theirs:
        mine = ours[tensor.name]
        assert mine.type_name == tensor.tensor_type.name
        assert np.array_equal(mine.data.reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))


def test_our_gguf_metadata_is_gguf_pys_but_the_arrays():
    theirs = GGUFReader(str(embedded_gguf_path())).fields
    arrays = {name for name, field in theirs.items() if field.types[0] == GGUFValueType.ARRAY}
    assert "tokenizer.ggml.tokens" in arrays
    ours = read_metadata(embedded_gguf_path())
    header = {name for name in theirs if name.startswith("GGUF.")}  # gguf-py's: the counts, version
    assert ours == {name: field.contents() for name, field in theirs.items() if name not in arrays | header}
    assert ours["general.architecture"] == "llama" and ours["llama.block_count"] == 30


def test_the_embedded_files_blocks_are_its_converted_weights(model_dir):
    """Q4_1 layers (q and k put back in Hugging Face's rotary order) and the Q8_0 embedding,
    packed, dequantize to exactly what transformers' converter wrote."""
    tensors = read_tensors(embedded_gguf_path())
    cases = [
        ("blk.5.attn_q.weight", "model.layers.5.self_attn.q_proj.weight", 9),
        ("blk.5.attn_k.weight", "model.layers.5.self_attn.k_proj.weight", 3),
        ("blk.5.attn_v.weight", "model.layers.5.self_attn.v_proj.weight", None),
        ("blk.5.ffn_down.weight", "model.layers.5.mlp.down_proj.weight", None),
        ("token_embd.weight", "model.embed_tokens.weight", None),
    ]
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as converted:
        for gguf_name, hf_name, heads in cases:
            tensor = tensors[gguf_name]
            block = DECODERS[tensor.type_name](torch.from_numpy(tensor.data.copy()))
            if heads is not None:
                block = block.rows(rotary_rows(block.codes.shape[0], heads))
            weight = block.packed()
            expected = converted.get_tensor(hf_name)
            assert torch.equal(dequantize(weight), expected), gguf_name
            x = torch.randn(3, expected.shape[1])
            out = cpu_kernels.linear(x, weight)
            assert (out - _int16_rows(x) @ expected.T).abs().max() <= 1e-5 * out.abs().max()


def test_auto_serves_the_embedded_model_from_its_own_blocks(llm):
    assert llm.engine.config.quantization == "gguf"  # every default but dtype
    model = llm.engine.core.runner.model
    held = [m.packed for m in model.modules() if hasattr(m, "packed") and m.packed is not None]
    assert held and all(isinstance(w, QuantizedWeight) for w in held)
    assert model.model.embed_tokens.weight is None  # looked up from the quantized rows
    # Resident weights about the file's size: no float copy beside the blocks.
    quantized = sum(w.nbytes for w in held) + model.quantized_embeddings.nbytes
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    file_bytes = embedded_gguf_path().stat().st_size
    assert 0.9 * file_bytes <= quantized + floats <= 1.1 * file_bytes


def test_native_greedy_outputs_follow_the_dequantized_path_up_to_near_ties(llm, exact_llm):
    """Int16 activations move logits by ~1e-4: a prompt may part from the dequantized path's
    continuation only at a near-tie of that path's two best tokens."""
    reference = exact_llm.generate(EXACTNESS_PROMPTS, GREEDY_PARAMS)
    gaps = [parted["top2_logprob_gap"] for parted in divergences(llm, reference)]
    print("divergences' top-2 logprob gaps:", gaps)
    assert all(gap < 1e-2 for gap in gaps), gaps
    manager = llm.engine.core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_perplexity_of_int8_and_of_the_files_blocks_against_float32(llm, exact_llm):
    windows = text_prompts(llm.tokenizer, [256] * 6, seed=0)
    reference = perplexity(exact_llm, windows)
    int8 = perplexity(LLM(dtype="float32", quantization="int8"), windows)
    assert abs(int8 / reference - 1) <= 0.02, (int8, reference)
    assert abs(perplexity(llm, windows) / reference - 1) <= 0.005


def test_int8_serves_a_model_without_a_gguf_file():
    settings = dict(model="dummy:tiny-llama", dtype="float32", kv_cache_bytes=16 << 20, max_model_len=256)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    llm = LLM(**settings, quantization="int8")
    assert isinstance(llm.engine.core.runner.model.model.layers[0].mlp.down_proj.packed, QuantizedWeight)
    [out] = llm.generate([[5, 6, 7, 8]], params)
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "settings,named",
    [
        ({"quantization": "fp4"}, "quantization"),
        ({"quantization": "int8", "device": "cuda"}, "quantization"),
        ({"quantization": "gguf", "device": "cuda:0"}, "quantization"),
    ],
)
def test_bad_quantization_settings_are_refused_by_name(settings, named):
    with pytest.raises(InvalidRequestError) as error:
        EngineConfig(**settings)
    assert error.value.param == named


def test_gguf_needs_a_gguf_model_and_one_worker():
    from transformers import LlamaConfig

    model_config = LlamaConfig(max_position_embeddings=64, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(InvalidRequestError, match=r"needs a \.gguf model"):
        EngineConfig(model="dummy:tiny-llama", quantization="gguf").resolve(model_config)
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
        EngineConfig(quantization="gguf", tensor_parallel_size=2).resolve(model_config)
    assert EngineConfig(tensor_parallel_size=2).resolve(model_config).quantization == "none"


@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES[:4] + SHAPES[5:])
def test_prompt_rows_meet_the_weight_dequantized_to_bfloat16(bits, group, n, k):
    """A step's prompt rows in bfloat16 (kernels/prompt_rows.py) meet the weight dequantized to
    bfloat16: bit for bit what the packed kernel computes over dequantize(W).to(bfloat16), each row
    the same whatever else the step holds; other rows, and other tensors, keep the int16 path."""
    from replica_engine.kernels.prompt_rows import PromptRows, prompt_rows

    weight = _random_weight(bits, group, n, k, seed=n * k)
    packed = cpu_kernels.pack_weight(dequantize(weight).bfloat16())
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    dense = cpu_kernels.linear(x, packed)
    int16 = cpu_kernels.linear(x, weight)
    assert not torch.equal(dense, int16)
    mask = torch.rand(37, generator=torch.Generator().manual_seed(n)) < 0.5
    for rows, prompt in [
        (PromptRows(37, 0, None), torch.ones(37, dtype=torch.bool)),
        (PromptRows(37, 30, None), torch.arange(37) >= 30),
        (PromptRows(37, None, mask), mask),
    ]:
        with prompt_rows(rows):
            out = cpu_kernels.linear(x, weight)
            assert torch.equal(cpu_kernels.linear(x[:5], weight), int16[:5])  # not the step's rows
        assert torch.equal(out[prompt], dense[prompt]) and torch.equal(out[~prompt], int16[~prompt])
    with prompt_rows(PromptRows(1, 0, None)):  # a row alone: the same numbers as among 37
        assert torch.equal(cpu_kernels.linear(x[7:8], weight)[0], dense[7])
        assert cpu_kernels.linear(x[7:8].float(), weight).dtype == torch.float32  # float32: int16 always


def test_prompt_rows_are_found_from_each_rows_prompt_tokens():
    from replica_engine.kernels.prompt_rows import PromptRows

    assert PromptRows.of([(1, 0), (1, 0)]) is None  # decodes alone
    assert PromptRows.of([(1, 0), (1, 0), (5, 5), (3, 3)]) == PromptRows(10, 2, None)
    mixed = PromptRows.of([(1, 0), (4, 2), (2, 2)])  # a recomputed request's chunk: prompt, then its output
    assert mixed is not None and mixed.first is None
    assert mixed.mask.tolist() == [False, True, True, False, False, True, True]


def test_a_tokens_numbers_in_bfloat16_are_the_same_whatever_shares_its_steps(llm):
    """The default engine in bfloat16: prompts sent together in small chunks beside decodes give
    each one's tokens and logprobs, prompt and output, exactly as it gets alone in one chunk."""
    prompts = [list(range(1000, 1000 + n)) for n in (5, 40, 77)]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, prompt_logprobs=1)
    alone = LLM(dtype="bfloat16")
    chunked = LLM(dtype="bfloat16", max_num_batched_tokens=16, enable_prefix_caching=False)
    outputs = [alone.generate([p], params)[0] for p in prompts] + chunked.generate(prompts, params)
    for one, shared in zip(outputs[:3], outputs[3:], strict=True):
        assert one.outputs[0].token_ids == shared.outputs[0].token_ids
        assert one.outputs[0].logprobs == shared.outputs[0].logprobs
        assert one.prompt_logprobs == shared.prompt_logprobs
    windows = text_prompts(alone.tokenizer, [256] * 3, seed=1)  # and the model is still itself
    reference = perplexity(llm, windows)
    assert abs(perplexity(alone, windows) / reference - 1) <= 0.02
