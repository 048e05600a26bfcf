"""Prefix caching changes where K/V comes from, never the answer: greedy outputs with caching on
equal those with it off and Hugging Face's (up to near-ties, harness/hf_reference.py), for a prompt
sent twice, a shared 600-token prefix, a conversation resent turn by turn, a pool so small that
cached blocks are evicted and requests preempted, and a 16-token budget (blocks filling
mid-prefill). The real SmolLM2, fp32."""

from __future__ import annotations

import pytest

from harness.hf_reference import assert_matches_up_to_ties, hf_greedy_batch
from replica_engine import LLM, SamplingParams
from tests.engine.test_engine_integrity import story_ids

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    prefix = story_ids(tokenizer, 600)
    questions = [tokenizer.encode(f" Question {i}: what did the keeper see on night {i}?") for i in range(4)]
    return {
        "twice": story_ids(tokenizer, 200, offset=40),
        **{f"shared_{i}": prefix + q for i, q in enumerate(questions[:3])},
        "turn_question": questions[3],
    }


@pytest.fixture(scope="module")
def reference(hf_model):
    """Hugging Face's greedy continuations of a batch of prompts, each computed once (those not
    yet known, in one batch)."""
    cache: dict[tuple[int, ...], list[int]] = {}

    def continuations(batch: list[list[int]]) -> list[list[int]]:
        missing = list({tuple(ids): ids for ids in batch if tuple(ids) not in cache}.values())
        if missing:
            found = hf_greedy_batch(hf_model, missing, MAX_TOKENS)
            cache.update(zip(map(tuple, missing), found, strict=True))
        return [cache[tuple(ids)] for ids in batch]

    return continuations


def _check(hf_model, reference, llm: LLM, batch: list[list[int]], label: str) -> list:
    outputs = llm.generate(batch, GREEDY)
    for prompt_ids, output, theirs in zip(batch, outputs, reference(batch), strict=True):
        assert_matches_up_to_ties(hf_model, prompt_ids, output.outputs[0].token_ids, theirs, label)
    return outputs


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_repeats_shared_prefixes_and_conversations(enable_prefix_caching, prompts, hf_model, reference):
    llm = LLM(dtype="float32", quantization="none", enable_prefix_caching=enable_prefix_caching)
    label = f"caching {'on' if enable_prefix_caching else 'off'}"

    first, second = (_check(hf_model, reference, llm, [prompts["twice"]], label)[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (192 if enable_prefix_caching else 0)  # 12 full blocks of 200

    _check(hf_model, reference, llm, [prompts["shared_0"]], label)
    later = _check(hf_model, reference, llm, [prompts["shared_1"], prompts["shared_2"]], label)
    assert [o.num_cached_tokens for o in later] == [592 if enable_prefix_caching else 0] * 2  # 37 blocks

    conversation = prompts["shared_0"]
    for turn in range(3):  # resend the history with the answer and a new question
        (answer,) = _check(hf_model, reference, llm, [conversation], f"{label}, turn {turn}")
        if enable_prefix_caching:
            assert answer.num_cached_tokens >= (len(conversation) - MAX_TOKENS - 20) // BLOCK * BLOCK
        conversation = conversation + answer.outputs[0].token_ids + prompts["turn_question"]
    # Idle: every block is free, and KV pressure ignores what is merely cached (evictable).
    stats = llm.engine.core.stats
    assert stats.num_free_blocks == stats.num_total_blocks and stats.kv_cache_usage == 0
    assert (stats.num_cached_free_blocks > 0) == enable_prefix_caching


def test_a_tiny_pool_evicts_cached_blocks_and_preempts_without_changing_outputs(
    tokenizer, hf_model, reference
):
    prefix = story_ids(tokenizer, 64)  # 4 blocks
    shared = [
        prefix + tokenizer.encode(f" Question {i}: what did the keeper see on night {i}?") for i in range(6)
    ]
    others = [story_ids(tokenizer, 80, offset=200 + 100 * i)[::-1] for i in range(2)]
    # 160 tokens for 7 prompts of ~80 tokens
    llm = LLM(dtype="float32", quantization="none", num_kv_blocks=10)
    _check(hf_model, reference, llm, shared[:1], "tiny pool")
    outputs = _check(hf_model, reference, llm, shared[1:4] + others + shared[4:], "tiny pool")
    cached = [output.num_cached_tokens for output in outputs]
    assert cached[:3] == [64] * 3  # found the first request's prefix ...
    assert cached[5] == 0  # ... which the other prompts then evicted; computed again, and
    assert cached[6] == 64  # the last one waited for that, to read it
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.kv_cache_manager.num_free_blocks == 10


def test_blocks_filled_mid_prefill_are_found_by_the_next_request(prompts, hf_model, reference):
    llm = LLM(dtype="float32", quantization="none", max_num_batched_tokens=16)
    _check(hf_model, reference, llm, [prompts["shared_0"]], "budget 16")
    (later,) = _check(hf_model, reference, llm, [prompts["shared_1"]], "budget 16")
    assert later.num_cached_tokens == 592


def test_requests_with_different_salts_share_nothing(prompts, llm):
    def cached_tokens(salt: str | None) -> int:
        params = SamplingParams(max_tokens=2, temperature=0, cache_salt=salt)
        return llm.generate([prompts["twice"][:100]], params)[0].num_cached_tokens

    assert cached_tokens("tenant-a") == 0
    assert cached_tokens("tenant-b") == 0
    assert cached_tokens(None) == 0
    assert cached_tokens("tenant-a") == 96
