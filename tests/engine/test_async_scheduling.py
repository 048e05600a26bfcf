"""Async scheduling on the real SmolLM2 engine (fp32): the core schedules and submits step N+1
while step N is in flight, its requests' tokens from N as placeholders the runner fills in. On a
CPU the runner computes a step when it is submitted, so these tests hold the order and the
bookkeeping (which the GPU shares): the same tokens as synchronous steps whatever the sampling,
chunking, prefix cache or preemption; nothing sent past a stop; aborts, grammars and faults."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from common.structured_outputs import StructuredOutputs
from replica_engine import LLM, SamplingParams
from replica_engine.errors import StepFailedError
from replica_engine.scheduler.plan import PLACEHOLDER_TOKEN_ID, ScheduledBatch

SHARED = "You are a helpful assistant. Answer in one short sentence, then stop. Question: "
PROMPTS = [
    SHARED + "What is the capital of France?",
    SHARED + "Why is the sky blue?",  # shares its first blocks with the one before: the prefix cache
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
]
PARAMS = [
    SamplingParams(max_tokens=20, temperature=0.0),
    SamplingParams(max_tokens=20, temperature=0.0, logprobs=3),
    SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7),
    SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=1.0, repetition_penalty=1.3),
    SamplingParams(max_tokens=20, temperature=0.0, min_tokens=6),
    SamplingParams(max_tokens=3, temperature=0.0),  # ends by length early, beside longer ones
]
CONFIGS = {
    "default": {},
    # prompts chunked beside decodes, and a pool of 5 blocks (80 tokens) for ~200: preemption
    "chunks_and_preemption": {"max_num_batched_tokens": 16, "num_kv_blocks": 5},
}


@dataclass
class Submissions:
    """What the core handed the real runner, in order: each batch, and how many were pending."""

    batches: list[ScheduledBatch] = field(default_factory=list)
    pending_at_submit: list[int] = field(default_factory=list)

    @property
    def with_placeholders(self) -> list[ScheduledBatch]:
        return [b for b in self.batches if any(PLACEHOLDER_TOKEN_ID in r.token_ids for r in b.rows)]


def watch(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> Submissions:
    runner = llm.engine.core.runner
    seen = Submissions()
    submit, collect = runner.submit, runner.collect
    pending = [0]

    def watched_submit(batch: ScheduledBatch) -> None:
        seen.batches.append(batch)
        seen.pending_at_submit.append(pending[0])
        submit(batch)
        pending[0] += 1

    def watched_collect():
        pending[0] -= 1
        return collect()

    monkeypatch.setattr(runner, "submit", watched_submit)
    monkeypatch.setattr(runner, "collect", watched_collect)
    return seen


def assert_pool_free(llm: LLM) -> None:
    manager = llm.engine.core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_the_same_tokens_and_logprobs_as_synchronous_steps(config_name, monkeypatch):
    config = {"dtype": "float32", **CONFIGS[config_name]}
    expected = LLM(async_scheduling=False, **config).generate(PROMPTS, PARAMS)
    llm = LLM(async_scheduling=True, **config)
    seen = watch(llm, monkeypatch)
    outputs = llm.generate(PROMPTS, PARAMS)
    for ours, theirs in zip([o.outputs[0] for o in outputs], [o.outputs[0] for o in expected], strict=True):
        assert (ours.token_ids, ours.finish_reason) == (theirs.token_ids, theirs.finish_reason)
        for mine, sync in zip(ours.logprobs or [], theirs.logprobs or [], strict=True):
            assert mine.token_id == sync.token_id and mine.rank == sync.rank
            assert mine.logprob == pytest.approx(sync.logprob, abs=1e-4)
    # Step N+1 went to the runner while N was pending, its requests' tokens as placeholders.
    assert max(seen.pending_at_submit) == 1 and seen.with_placeholders
    assert_pool_free(llm)
    if config_name == "chunks_and_preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0
        mixed = [b for b in seen.batches if {r.is_decode for r in b.rows} == {True, False}]
        assert mixed, "no step mixed a prompt chunk with decodes"
    else:
        assert llm.engine.core.kv_cache_manager.cached_hashes()  # the shared prefix was cached


def test_nothing_is_sent_past_a_stop_and_the_step_computed_after_it_is_dropped(llm: LLM, monkeypatch):
    prompt = "1, 2, 3, 4,"
    greedy = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0].token_ids
    stop_at = greedy[4]
    assert stop_at not in greedy[:4]
    stopping = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at])
    async_llm = LLM(dtype="float32", async_scheduling=True)
    seen = watch(async_llm, monkeypatch)
    out = async_llm.generate([prompt], stopping)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (greedy[:5], "stop")
    # The batch after the stopping token's was already on its way: it computed one more row.
    rows = [r for b in seen.batches for r in b.rows]
    assert len(rows) == 1 + 5  # the prompt (sampling the first token), then a decode per token
    assert_pool_free(async_llm)


def test_an_abort_while_its_batch_is_in_flight_sends_nothing_more(llm: LLM, monkeypatch):
    params = SamplingParams(max_tokens=10, temperature=0.0)
    expected = llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids
    async_llm = LLM(dtype="float32", async_scheduling=True)
    seen = watch(async_llm, monkeypatch)
    engine = async_llm.engine
    engine.add_request("Once upon a time", params, "keeper")
    engine.add_request("The three primary colors are", params, "aborted")
    tokens: dict[str, list[int]] = {"keeper": [], "aborted": []}
    for _ in range(3):
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert seen.pending_at_submit[-1] == 1  # a batch holding both is in flight now
    final = engine.abort_request("aborted")
    assert final is not None and final.finish_reason == "abort"
    sent_before = list(tokens["aborted"])
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert tokens["aborted"] == sent_before and tokens["keeper"] == expected
    assert_pool_free(async_llm)


def test_steps_go_one_at_a_time_while_a_constrained_request_runs(llm: LLM, monkeypatch):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = SamplingParams(
        max_tokens=16,
        temperature=0.0,
        structured_outputs=StructuredOutputs.from_schema(schema, True, "response_format"),
    )
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = ["Give a number as JSON:", "Once upon a time"]
    expected = llm.generate(prompts, [constrained, plain])
    async_llm = LLM(dtype="float32", async_scheduling=True)
    seen = watch(async_llm, monkeypatch)
    outputs = async_llm.generate(prompts, [constrained, plain])
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    json.loads(outputs[0].outputs[0].text)
    with_grammar = [b for b in seen.batches if any(r.sampling and r.sampling.grammar for r in b.rows)]
    assert with_grammar and not set(map(id, with_grammar)) & set(map(id, seen.with_placeholders))
    # Once it ended, the plain request's steps went ahead again.
    assert seen.with_placeholders and seen.batches.index(seen.with_placeholders[0]) > seen.batches.index(
        with_grammar[-1]
    )
    assert_pool_free(async_llm)


def test_a_batch_failing_on_submit_fails_only_its_faulty_request(llm: LLM, monkeypatch):
    params = SamplingParams(max_tokens=10, temperature=0.0)
    prompts = ["The capital of France is", "1, 2, 3,"]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    async_llm = LLM(dtype="float32", async_scheduling=True)
    runner = async_llm.engine.core.runner
    submit = runner.submit
    pending_at_faults: list[int] = []

    def faulty_submit(batch: ScheduledBatch) -> None:
        if any(row.request_id == "poison" and row.start_position > 0 for row in batch.rows):
            pending_at_faults.append(len(runner._pending))
            raise RuntimeError("injected fault")  # mid-decode
        submit(batch)

    monkeypatch.setattr(runner, "submit", faulty_submit)
    engine = async_llm.engine
    ids = [engine.add_request(p, params, f"good-{i}") for i, p in enumerate(prompts)]
    engine.add_request("Hello there", params, "poison")
    results: dict[str, tuple[list[int], str | None]] = {r: ([], None) for r in [*ids, "poison"]}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens, _ = results[output.request_id]
            results[output.request_id] = (tokens + output.new_token_ids, output.finish_reason)
    assert results["poison"][1] == "error"
    assert pending_at_faults[0] == 1  # it failed scheduled ahead, beside a batch in flight
    assert [results[i] for i in ids] == [(tokens, "length") for tokens in expected]
    assert_pool_free(async_llm)


def test_async_scheduling_is_refused_with_parallel_workers_and_a_non_boolean():
    from common.errors import InvalidRequestError
    from replica_engine.config import EngineConfig

    with pytest.raises(InvalidRequestError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(InvalidRequestError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")  # type: ignore[arg-type]


def test_a_batch_behind_a_whole_failure_still_runs_and_nothing_is_left_in_flight(llm: LLM, monkeypatch):
    # Step N holds only `a`; N+1, scheduled ahead, holds a's next token and b's prompt. N+1 fails
    # on submit, and N, collected first, fails whole: a ends with error, and b's rows still run.
    params = SamplingParams(max_tokens=6, temperature=0.0)
    expected = llm.generate(["1, 2, 3,"], params)[0].outputs[0].token_ids
    async_llm = LLM(dtype="float32", async_scheduling=True)
    engine, runner = async_llm.engine, async_llm.engine.core.runner
    engine.add_request("Once upon a time", params, "a")
    assert engine.step() == []  # N submitted, still in flight
    engine.add_request("1, 2, 3,", params, "b")
    submit, collect = runner.submit, runner.collect

    def faulty_submit(batch: ScheduledBatch) -> None:
        if any(row.request_id == "a" for row in batch.rows):
            raise RuntimeError("injected fault on submit")
        submit(batch)

    def faulty_collect():
        output = collect()
        if engine.core.scheduler.requests.get("a") is not None:
            raise RuntimeError("injected fault on collect")
        return output

    monkeypatch.setattr(runner, "submit", faulty_submit)
    monkeypatch.setattr(runner, "collect", faulty_collect)
    with pytest.raises(StepFailedError) as failure:
        engine.step()
    finals = {o.request_id: o for o in failure.value.outputs}
    assert finals["a"].finish_reason == "error"
    tokens = list(finals["b"].new_token_ids)  # b's prompt ran, its first token sampled
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == expected
    assert_pool_free(async_llm)
