"""Prefill/decode disaggregation in the engine: a prefill engine exports a finished prompt's full
blocks (KvBlocks), a decode engine adopts them into its pool as prefix-cache blocks and computes
only the rest. The answer is the colocated engine's (greedy, up to near-ties against transformers;
seeded sampling too: every sampled token is the decode engine's), the adopted K/V is the prefill's
byte for byte, blocks of another prompt or layout are refused (the prompt is computed instead), and
no block stays held on either side. The real SmolLM2, fp32, two engines in this process."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from common.kv_transfer import KvBlocks
from common.sampling_params import SamplingParams
from harness.hf_reference import assert_matches_up_to_ties
from replica_engine import LLM
from replica_engine.engine import LLMEngine
from replica_engine.outputs import RequestDelta
from tests.engine.test_engine_integrity import story_ids

BLOCK = 16
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine]:
    """A prefill engine and a decode engine, as `exact_llm` (the colocated reference) is built."""
    prefill, decode = (LLM(dtype="float32", quantization="none").engine for _ in range(2))
    return prefill, decode


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams, **kv_args) -> list[RequestDelta]:
    request_id = engine.add_request(prompt, params, **kv_args)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def _tokens(outputs: list[RequestDelta]) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]


def _prefill(engine: LLMEngine, prompt: list[int]) -> KvBlocks:
    (final,) = [o for o in _run(engine, prompt, SamplingParams(max_tokens=1, temperature=0), kv_export=True)]
    assert final.finished and final.kv is not None
    return final.kv


def _assert_idle(*engines: LLMEngine) -> None:
    for engine in engines:
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, "a block is still held"


def test_decode_adopts_the_prefill_blocks_and_answers_as_colocated(engines, exact_llm, tokenizer, hf_model):
    prefill, decode = engines
    for length in (300, 321):  # 18 full blocks and 12 tokens; 20 and 1
        prompt = story_ids(tokenizer, length, offset=length // 10)
        assert len(prompt) == length
        kv = _prefill(prefill, prompt)
        assert kv.num_blocks == (length - 1) // BLOCK and kv.data is not None and kv.data.nbytes == kv.nbytes
        outputs = _run(decode, prompt, GREEDY, kv=kv)
        assert outputs[-1].num_cached_tokens == kv.num_blocks * BLOCK  # adopted, not computed
        (colocated,) = exact_llm.generate([prompt], GREEDY)
        assert_matches_up_to_ties(
            hf_model, prompt, _tokens(outputs), colocated.outputs[0].token_ids, f"P/D, {length} tokens"
        )
        _assert_idle(prefill, decode)


def test_adopted_blocks_hold_the_prefill_bytes_and_seeded_sampling_is_the_decode_engines(
    engines, exact_llm, tokenizer
):
    prefill, decode = engines
    prompt = story_ids(tokenizer, 200, offset=7)
    kv = _prefill(prefill, prompt)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    outputs = _run(decode, prompt, seeded, kv=kv)
    (colocated,) = exact_llm.generate([prompt], seeded)
    assert _tokens(outputs) == colocated.outputs[0].token_ids
    # The decode pool's copy, found by the prompt's own hashes, is what the prefill engine sent.
    assert _pool_bytes(decode, prompt, kv.num_blocks) == kv.data.tobytes()
    _assert_idle(prefill, decode)


def _empty_prefix_cache(engine: LLMEngine) -> None:
    engine.core.kv_cache_manager = type(engine.core.kv_cache_manager)(
        engine.core.kv_cache_manager.num_blocks, BLOCK, True, model=engine.config.model
    )
    engine.core.scheduler.kv_cache_manager = engine.core.kv_cache_manager


def _pool_bytes(engine: LLMEngine, prompt: list[int], num_blocks: int) -> bytes:
    """The engine's pool copy of the prompt's first full blocks, found by the prompt's hashes."""
    core = engine.core
    request = dataclasses.replace(engine.inputs.make_request(prompt, None, None, ()), block_hashes=[])
    hashes = core.kv_cache_manager.block_hashes(request, num_blocks)
    block_ids = [core.kv_cache_manager.cached_block(h) for h in hashes]
    assert None not in block_ids
    return core.runner.read_kv_blocks(block_ids).tobytes()


def test_a_decode_engine_holding_the_first_blocks_writes_only_the_rest(
    engines, exact_llm, tokenizer, hf_model
):
    prefill, decode = engines
    prompt = story_ids(tokenizer, 200, offset=11)  # 12 full blocks and 8 tokens
    # A shared system prompt, say: 5 full blocks cached (one token out: its tokens fill no more)
    _run(decode, prompt[:90], SamplingParams(max_tokens=1, temperature=0))
    own = _pool_bytes(decode, prompt, 5)
    kv = _prefill(prefill, prompt)
    outputs = _run(decode, prompt, GREEDY, kv=kv)
    assert outputs[-1].num_cached_tokens == kv.num_blocks * BLOCK
    pool = np.frombuffer(_pool_bytes(decode, prompt, kv.num_blocks), np.uint8)
    layout = kv.layout
    by_block = pool.reshape(*layout.shape(kv.num_blocks)[:3], -1)  # layers, K/V, blocks, bytes
    sent = kv.data.reshape(by_block.shape)
    assert by_block[:, :, :5].tobytes() == own  # its own blocks kept (computed in another chunking)
    assert by_block[:, :, 5:].tobytes() == sent[:, :, 5:].tobytes()  # the rest, the prefill's bytes
    (colocated,) = exact_llm.generate([prompt], GREEDY)
    expected = colocated.outputs[0].token_ids
    assert_matches_up_to_ties(hf_model, prompt, _tokens(outputs), expected, "a prefix held")
    _assert_idle(prefill, decode)


def test_the_runner_writes_any_of_the_buffers_blocks_where_it_is_told(engines):
    _, decode = engines
    runner = decode.core.runner
    shape = runner.kv_layout.shape(3)
    data = torch.arange(int(np.prod(shape)), dtype=runner.config.torch_dtype)
    as_bytes = data.view(torch.uint8).numpy()
    for indices in ([0, 2], [1, 2], [2]):  # apart, consecutive from the middle, one
        targets = [7, 4][: len(indices)]
        runner.write_kv_blocks(targets, as_bytes, indices)
        expected = data.view(shape)[:, :, indices].contiguous().view(torch.uint8).numpy().tobytes()
        assert runner.read_kv_blocks(targets).tobytes() == expected, indices
    _empty_prefix_cache(decode)  # those pool blocks now hold other bytes than their hashes say


def test_blocks_of_another_prompt_or_layout_are_refused_and_the_prompt_computed(engines, tokenizer):
    prefill, decode = engines
    prompt, other = story_ids(tokenizer, 120, offset=3), story_ids(tokenizer, 120, offset=5)
    kv = _prefill(prefill, other)
    bf16 = dataclasses.replace(kv.layout, dtype="bfloat16", dtype_bytes=2)
    wrong_layout = dataclasses.replace(kv, layout=bf16)
    plain = _tokens(_run(decode, prompt, GREEDY))
    for label, blocks in (("another prompt", kv), ("another layout", wrong_layout)):
        _empty_prefix_cache(decode)
        outputs = _run(decode, prompt, GREEDY, kv=blocks)
        assert outputs[-1].num_cached_tokens == 0, label
        assert _tokens(outputs) == plain, label
    _assert_idle(prefill, decode)


def test_a_request_aborted_before_admission_lets_go_of_its_adopted_blocks(engines, tokenizer):
    prefill, decode = engines
    prompt = story_ids(tokenizer, 160, offset=9)
    kv = _prefill(prefill, prompt)
    request_id = decode.add_request(prompt, GREEDY, kv=kv)
    assert decode.stats().num_free_blocks == decode.stats().num_total_blocks - kv.num_blocks  # held
    decode.abort_request(request_id)
    _assert_idle(decode)
    # Still cached: the same prompt now finds them without bringing any.
    assert _run(decode, prompt, GREEDY)[-1].num_cached_tokens == kv.num_blocks * BLOCK
