"""Greedy outputs of our engine against Hugging Face `generate` on the same fp32 weights, up to
near-ties (harness/hf_reference.py)."""

from __future__ import annotations

import pytest

from harness.hf_reference import EXACTNESS_PROMPTS as PROMPTS
from harness.hf_reference import assert_matches_up_to_ties, hf_greedy_batch
from replica_engine import LLM, SamplingParams

MAX_TOKENS = 24

CONFIGS = {
    "large_budget": {},
    "budget_16": {"max_num_batched_tokens": 16},  # chunked prefill mixed with decodes
    "tiny_pool": {"num_kv_blocks": 12},  # 192 tokens for ~500: preemption
    # a TBT target far below one step of every prompt: the step-time model picks the chunks
    "tbt_slo": {"tbt_slo_s": 0.02, "max_num_batched_tokens": 512},
}


@pytest.fixture(scope="module")
def hf_outputs(hf_model, tokenizer) -> list[list[int]]:
    return hf_greedy_batch(hf_model, [tokenizer(prompt).input_ids for prompt in PROMPTS], MAX_TOKENS)


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_outputs_match_transformers(config_name, hf_model, tokenizer, hf_outputs):
    llm = LLM(dtype="float32", quantization="none", **CONFIGS[config_name])
    steps = []
    llm.engine.step_listeners.append(steps.append)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))

    for prompt, ours, theirs in zip(PROMPTS, outs, hf_outputs, strict=True):
        assert_matches_up_to_ties(
            hf_model, tokenizer(prompt).input_ids, ours.outputs[0].token_ids, theirs, config_name
        )

    assert llm.engine.core.kv_cache_manager.num_free_blocks == llm.engine.core.kv_cache_manager.num_blocks
    if config_name == "budget_16":
        mixed = [s for s in steps if s.num_prefill_requests and s.num_decode_requests]
        assert mixed, "no step mixed a prefill chunk with decodes"
        assert max(s.num_prefill_tokens + s.num_decode_requests for s in steps) <= 16
    if config_name == "tbt_slo":
        prompt_steps = [s.num_prefill_tokens for s in steps if s.num_prefill_tokens]
        assert len(prompt_steps) > 1 and max(prompt_steps) < sum(prompt_steps), prompt_steps
    if config_name == "tiny_pool":
        assert llm.engine.core.scheduler.num_preemptions > 0
        assert sum(s.num_preempted for s in steps) == llm.engine.core.scheduler.num_preemptions
