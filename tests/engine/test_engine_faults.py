"""An exception inside a model step, on the real SmolLM2 engine. A fault cannot be caused on
purpose on a CPU, so a wrapper around the model runner raises for chosen requests; everything
else (scheduler, KV cache, model, sampler) is the real one."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from replica_engine import LLM, SamplingParams
from replica_engine.errors import StepFailedError
from replica_engine.scheduler.plan import ScheduledBatch

PARAMS = SamplingParams(max_tokens=10, temperature=0)


def fail_when(llm: LLM, monkeypatch: pytest.MonkeyPatch, poisoned: Callable[[str], bool]) -> None:
    """Make the runner raise for any batch holding a request whose id `poisoned` picks."""
    execute = llm.engine.core.runner.execute

    def faulty_execute(batch: ScheduledBatch) -> list[int]:
        if any(poisoned(row.request_id) for row in batch.rows):
            raise RuntimeError("injected fault")
        return execute(batch)

    monkeypatch.setattr(llm.engine.core.runner, "execute", faulty_execute)


def run_to_end(llm: LLM, request_ids: list[str]) -> dict[str, tuple[list[int], str | None]]:
    results = {request_id: ([], None) for request_id in request_ids}
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            tokens, _ = results[output.request_id]
            results[output.request_id] = (tokens + output.new_token_ids, output.finish_reason)
    return results


def test_a_failing_request_fails_alone_and_its_batch_mates_are_untouched(llm, monkeypatch):
    prompts = ["The capital of France is", "1, 2, 3,", "def square(x):"]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    fail_when(llm, monkeypatch, lambda request_id: request_id == "poison")
    engine = llm.engine
    ids = [engine.add_request(p, PARAMS, f"good-{i}") for i, p in enumerate(prompts)]
    engine.add_request("Hello there", PARAMS, "poison")
    results = run_to_end(llm, [*ids, "poison"])
    assert results["poison"] == ([], "error")
    assert [results[i] for i in ids] == [(tokens, "length") for tokens in expected]
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_a_request_failing_mid_decode_ends_with_error_and_frees_its_blocks(llm, monkeypatch):
    expected = llm.generate("Count: 1, 2,", PARAMS)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("Count: 1, 2,", PARAMS, "late-poison")
    engine.add_request("Count: 1, 2,", PARAMS, "good")
    first_tokens = [o.new_token_ids[0] for _ in range(3) for o in engine.step() if o.request_id == "good"]
    fail_when(llm, monkeypatch, lambda request_id: request_id == "late-poison")
    results = run_to_end(llm, ["late-poison", "good"])
    assert results["late-poison"] == ([], "error")  # no token of the failed step is sent
    assert results["good"] == (expected[3:], "length") and first_tokens == expected[:3]
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_a_step_where_every_request_fails_raises_after_finishing_them(llm, monkeypatch):
    fail_when(llm, monkeypatch, lambda request_id: True)
    ids = [llm.engine.add_request(p, PARAMS) for p in ["Hello", "Goodbye"]]
    with pytest.raises(StepFailedError) as failure:
        llm.engine.step()
    assert {(o.request_id, o.finish_reason) for o in failure.value.outputs} == {(i, "error") for i in ids}
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_total_blocks
