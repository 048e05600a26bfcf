"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers on tiny random
checkpoints in float32: greedy tokens and their logprobs, with prompts chunked and requests
preempted; split over two workers (by expert width, and by experts) against one; int8 experts
against their dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import InvalidRequestError
from common.lora import LoRARequest
from common.model_source import embedded_gguf_path
from harness.hf_reference import assert_matches_up_to_ties
from harness.lora_adapters import save_random_adapter
from harness.tiny_moe import CONFIGS, save_tiny_moe, tiny_moe, write_qwen3_moe_gguf
from replica_engine import LLM, SamplingParams
from replica_engine.kernels import cpu as cpu_kernels
from replica_engine.kernels.quantized_weight import QuantizedWeight, dequantize, quantize_int8
from replica_engine.models.moe import Experts, MoeShape
from replica_engine.parallel.tensor_parallel import check_divisible

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time in a land far away, there lived a king who had three daughters. The eldest",
]
LOGPROB_TOLERANCE = 1e-4
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory, model_dir: Path) -> tuple[str, torch.nn.Module, Path]:
    hf = tiny_moe(request.param)
    directory = save_tiny_moe(hf, tmp_path_factory.mktemp(request.param), model_dir)
    return request.param, hf, directory


def hf_logprobs(hf, ids: list[int], num_prompt: int) -> list[float]:
    """Transformers' logprob of each output token, from one forward pass over prompt + output."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(num_prompt, len(ids))]


def test_greedy_tokens_and_logprobs_match_transformers_chunked_and_preempted(checkpoint, tokenizer):
    architecture, hf, directory = checkpoint
    # An 8-token budget chunks every prompt; 4 blocks of 16 tokens for 3 requests preempts.
    llm = LLM(str(directory), dtype="float32", max_num_batched_tokens=8, num_kv_blocks=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    manager = llm.engine.core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    for prompt, out in zip(PROMPTS, outs, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        ours = out.outputs[0].token_ids
        with torch.no_grad():
            ids = torch.tensor([prompt_ids])
            theirs = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
            )
        assert_matches_up_to_ties(hf, prompt_ids, ours, theirs[0, len(prompt_ids) :].tolist(), architecture)
        expected = hf_logprobs(hf, prompt_ids + ours, len(prompt_ids))
        mine = [entry.logprob for entry in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(mine, expected, strict=True)) <= LOGPROB_TOLERANCE


def test_the_router_follows_each_config(checkpoint):
    """Top-k of the softmax, renormalised only where the config says; the dense layers of
    `mlp_only_layers` stay dense."""
    architecture, hf, _ = checkpoint
    shape = MoeShape.of(hf.config)
    assert shape is not None
    assert shape.norm_topk_prob == (architecture != "qwen2_moe")
    assert shape.sparse_layers == ({0, 2} if architecture == "qwen3_moe" else {0, 1, 2})
    assert (shape.shared_width > 0) == (architecture == "qwen2_moe")


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["split_width", "split_experts"])
def test_two_workers_answer_as_one(expert_parallel, tmp_path: Path, model_dir: Path):
    """Qwen2-MoE (a shared expert, a dense-free stack) over gloo: each worker a slice of every
    expert, or half the experts; chunked and preempted as above."""
    directory = save_tiny_moe(tiny_moe("qwen2_moe"), tmp_path, model_dir)
    settings = dict(dtype="float32", max_num_batched_tokens=8, num_kv_blocks=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    whole = LLM(str(directory), **settings).generate(PROMPTS, params)
    split_llm = LLM(
        str(directory), **settings, tensor_parallel_size=2, enable_expert_parallel=expert_parallel
    )
    split = split_llm.generate(PROMPTS, params)
    for ours, theirs in zip(split, whole, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for mine, reference in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            assert abs(mine.logprob - reference.logprob) <= LOGPROB_TOLERANCE
    assert split_llm.engine.stats().num_preemptions > 0
    manager = split_llm.engine.core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_int8_experts_compute_what_their_dequantized_weights_do():
    """Quantized experts (in one call, and one call per expert) against plain matmuls of the same
    values, token by token (every token's picks differ; some experts get no token)."""
    gen = torch.Generator().manual_seed(0)
    experts = Experts(num_experts=6, hidden=64, width=32)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1, generator=gen)
        experts.down_proj.normal_(0, 0.1, generator=gen)
    stacked = (experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone())
    experts.hold([tuple(quantize_int8(w[e]) for w in stacked) for e in range(6)])
    x = torch.randn(5, 64, generator=gen)
    ids = torch.tensor([[0, 1], [1, 0], [3, 0], [1, 3], [0, 3]])  # experts 2, 4, 5 idle
    weights = torch.rand(5, 2, generator=gen)
    expected = torch.zeros(5, 64)
    for token in range(5):
        for slot in range(2):
            gate_up, down = (dequantize(w) for w in experts.kernel_weights[ids[token, slot]])
            assert isinstance(experts.kernel_weights[ids[token, slot]][0], QuantizedWeight)
            gate, up = (x[token] @ gate_up.T).chunk(2)
            expected[token] += weights[token, slot] * ((torch.nn.functional.silu(gate) * up) @ down.T)
    # the kernel rounds activations to int16 (test_quantized.py): that is all that differs
    assert experts.quantized is not None  # stacked: every expert in one call (quantized_moe)
    fused = experts(x, ids, weights)
    assert (fused - expected).abs().max() <= 1e-3 * expected.abs().max()
    experts.quantized = None  # one call per expert: the same roundings, summed in another order
    torch.testing.assert_close(experts(x, ids, weights), fused, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_the_fused_cpu_kernel_matches_one_matmul_pair_per_expert(dtype, num_tokens):
    """packed_moe (tokens grouped, weighted and summed in C++) against the per-expert path on the
    same weights, as worker 1 of 2 under expert parallelism (experts 4-7 of 8 held)."""
    if cpu_kernels.cpu_ops() is None:
        pytest.skip("the CPU kernels do not build here (no AVX-512 or no compiler)")
    gen = torch.Generator().manual_seed(num_tokens)
    held = Experts(num_experts=4, hidden=64, width=48)
    with torch.no_grad():
        held.gate_up_proj.normal_(0, 0.2, generator=gen)
        held.down_proj.normal_(0, 0.2, generator=gen)
    held.first = 4
    held = held.to(dtype)
    x = torch.randn(num_tokens, 64, generator=gen).to(dtype)
    ids = torch.rand(num_tokens, 8, generator=gen).topk(3, dim=-1).indices
    weights = torch.rand(num_tokens, 3, generator=gen)
    expected = held(x, ids, weights)  # float weights: one matmul pair per expert
    held.pack_for_cpu()
    assert held.packed is not None and held.gate_up_proj is None
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: rounded once, not per expert
    torch.testing.assert_close(held(x, ids, weights), expected, atol=tolerance, rtol=tolerance)


def test_a_gguf_mixture_serves_its_experts_in_their_own_blocks(tmp_path: Path, tokenizer):
    """A Qwen3-MoE written as llama.cpp writes one (3D expert tensors, Q8_0 blocks, the embedded
    SmolLM2's tokenizer): loaded from the file, each expert holds the file's 8-bit codes, and the
    logprobs match the same file served dequantized (`quantization: none`) but for the kernel's
    rounding of activations to int16."""
    path = write_qwen3_moe_gguf(
        tiny_moe("qwen3_moe", mlp_only_layers=[]), tmp_path / "moe.gguf", embedded_gguf_path()
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    native = LLM(str(path), dtype="float32")
    assert native.engine.config.quantization == "gguf"
    experts = native.engine.core.runner.model.model.layers[0].mlp.experts
    assert experts.num_experts == 8 and experts.kernel_weights is not None
    gate_up, down = experts.kernel_weights[5]
    assert (gate_up.bits, gate_up.out_features, gate_up.in_features) == (8, 64, 64)
    assert (down.out_features, down.in_features) == (64, 32)
    dequantized = LLM(str(path), dtype="float32", quantization="none")
    for ours, theirs in zip(
        native.generate(PROMPTS, params), dequantized.generate(PROMPTS, params), strict=True
    ):
        for mine, reference in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=False):
            if mine.token_id != reference.token_id:  # a near-tie went the other way: stop there
                break
            assert abs(mine.logprob - reference.logprob) <= 1e-2


def test_attention_adapters_apply_and_mlp_adapters_are_refused_by_name(tmp_path: Path, model_dir: Path):
    hf = tiny_moe("qwen3_moe")
    directory = save_tiny_moe(hf, tmp_path / "model", model_dir)
    attention = save_random_adapter(hf, tmp_path / "attention", seed=1, target_modules=("q_proj", "v_proj"))
    mlp = save_random_adapter(hf, tmp_path / "mlp", seed=2, target_modules=("q_proj", "down_proj"))
    llm = LLM(str(directory), dtype="float32", enable_lora=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    adapted = llm.generate(PROMPTS[:1], params, lora_request=LoRARequest("attention", str(attention)))
    assert adapted[0].outputs[0].token_ids != plain
    with pytest.raises(InvalidRequestError, match="experts"):  # peft's tensors for the experts
        llm.generate(PROMPTS[:1], params, lora_request=LoRARequest("mlp", str(mlp)))
    # the dense layer's MLP (mlp_only_layers) is refused too: no LoRA on a mixture's MLPs yet
    tensors = load_file(attention / "adapter_model.safetensors")
    dense = {k.replace("layers.1.self_attn.v_proj", "layers.1.mlp.down_proj"): v for k, v in tensors.items()}
    save_file(dense, attention / "adapter_model.safetensors")
    config = json.loads((attention / "adapter_config.json").read_text())
    (attention / "adapter_config.json").write_text(
        json.dumps({**config, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    )
    with pytest.raises(InvalidRequestError, match="'down_proj' of a mixture of experts"):
        llm.generate(PROMPTS[:1], params, lora_request=LoRARequest("dense", str(attention)))


def test_layouts_a_mixture_cannot_take_are_refused_by_name():
    with pytest.raises(
        InvalidRequestError, match=r"enable_expert_parallel: the model \(llama\) has no experts"
    ):
        LLM(model="dummy:tiny-llama", tensor_parallel_size=2, enable_expert_parallel=True)
    config = CONFIGS["mixtral"]()
    config.num_local_experts = 3
    with pytest.raises(
        InvalidRequestError, match="tensor_parallel_size: 2 does not divide the model's 3 experts"
    ):
        check_divisible(config, 2, expert_parallel=True)
    config.intermediate_size = 33  # Mixtral's expert width
    with pytest.raises(InvalidRequestError, match="2 does not divide the model's 33 expert width"):
        check_divisible(config, 2)
