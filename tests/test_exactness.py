"""Greedy outputs of our engine against Hugging Face `generate` on the same fp32 weights.

A flat batch sums in a different order than Hugging Face's layout, so a token may differ where
the two best logits are within 1e-4 of each other; the test allows that case alone, prints it,
and stops comparing that prompt there (the continuations then legitimately diverge)."""

from __future__ import annotations

import pytest
import torch

from replica_engine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Hello",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "List the planets of the solar system:",
    "Once upon a time in a land far away, there lived a king who had three daughters. The eldest was",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Water boils at 100 degrees Celsius at sea level. At the top of Mount Everest, water boils at "
    "a lower temperature because the air pressure is lower. Explain why, in simple terms:",
]
MAX_TOKENS = 24
TIE_TOLERANCE = 1e-4

CONFIGS = {
    "large_budget": {},
    "budget_16": {"max_num_batched_tokens": 16},  # chunked prefill mixed with decodes
    "tiny_pool": {"num_kv_blocks": 12},  # 192 tokens for ~500: preemption
}


@pytest.fixture(scope="module")
def hf_outputs(hf_model, tokenizer) -> list[list[int]]:
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def _top2_gap(hf_model, token_ids: list[int]) -> float:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0, -1]
    top2 = logits.topk(2).values
    return (top2[0] - top2[1]).item()


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_outputs_match_transformers(config_name, hf_model, tokenizer, hf_outputs):
    llm = LLM(dtype="float32", **CONFIGS[config_name])
    steps = []
    llm.engine.step_listeners.append(steps.append)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))

    for prompt, ours, theirs in zip(PROMPTS, outs, hf_outputs, strict=True):
        if ours.token_ids == theirs:
            continue
        position = next(
            (i for i, (a, b) in enumerate(zip(ours.token_ids, theirs, strict=False)) if a != b),
            min(len(ours.token_ids), len(theirs)),
        )
        context = tokenizer(prompt).input_ids + theirs[:position]
        gap = _top2_gap(hf_model, context)
        print(
            f"[{config_name}] divergence at output {position} of {prompt[:30]!r}: top-2 logit gap {gap:.2e}"
        )
        assert gap < TIE_TOLERANCE, (prompt, position, ours.token_ids, theirs)

    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.num_blocks
    if config_name == "budget_16":
        mixed = [s for s in steps if s.num_prefill_requests and s.num_decode_requests]
        assert mixed, "no step mixed a prefill chunk with decodes"
        assert max(s.num_prefill_tokens + s.num_decode_requests for s in steps) <= 16
    if config_name == "tiny_pool":
        assert llm.engine.core.scheduler.num_preemptions > 0
        assert sum(s.num_preempted for s in steps) == llm.engine.core.scheduler.num_preemptions
