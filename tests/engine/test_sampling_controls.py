"""Structured outputs, logprobs and sampling controls in the real engine (SmolLM2, fp32): a plain
request gets exactly its own tokens whatever shares its batch; logprobs equal transformers'
log-softmax; grammars hold through chunked prefill and preemption; penalties, min_tokens and
logit_bias do what they say."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from common.structured_outputs import StructuredOutputs
from replica_engine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "List three colors:", "def add(a, b):", "Once upon a time"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _json(strict: bool = True) -> StructuredOutputs:
    return StructuredOutputs.from_schema(SCHEMA, strict, "response_format")


def test_plain_requests_get_their_own_tokens_beside_constrained_logprob_and_penalized_ones(llm: LLM):
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in PROMPTS]
    others = [
        SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=_json()),
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, prompt_logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.9, presence_penalty=1.5, logit_bias={11: 30.0}, seed=3),
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=12, repetition_penalty=1.3, min_p=0.1),
    ]
    mixed = llm.generate(PROMPTS + PROMPTS, [greedy] * 4 + others)
    assert [out.outputs[0].token_ids for out in mixed[:4]] == alone
    json.loads(mixed[4].outputs[0].text)  # and the constrained one is JSON


def test_greedy_logprobs_equal_transformers_log_softmax(exact_llm: LLM, hf_model, tokenizer):
    prompt = "The capital of France is"
    out = exact_llm.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2)
    )[0]
    prompt_ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + out.outputs[0].token_ids])).logits[0].float()
    expected = logits.log_softmax(-1)
    for position, logprob in enumerate(out.outputs[0].logprobs):
        row = expected[len(prompt_ids) - 1 + position]
        assert logprob.token_id == out.outputs[0].token_ids[position] and logprob.rank == 1
        assert logprob.logprob == pytest.approx(row.max().item(), abs=1e-4)
        assert [t for t, _ in logprob.top] == row.topk(3).indices.tolist()
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt_ids) - 1
    for position, logprob in enumerate(out.prompt_logprobs):
        target = prompt_ids[position + 1]
        assert logprob.token_id == target
        assert logprob.logprob == pytest.approx(expected[position, target].item(), abs=1e-4)
        assert logprob.rank == int((expected[position] > expected[position, target]).sum()) + 1
        assert len(logprob.top) == 2


def test_prompt_logprobs_are_whole_through_chunks_the_prefix_cache_and_preemption():
    llm = LLM(dtype="float32", max_num_batched_tokens=16, num_kv_blocks=10)
    prompt = "Water boils at 100 degrees Celsius at sea level. At the top of a mountain it boils lower."
    params = SamplingParams(max_tokens=60, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    # the same prompt again (its blocks are cached now, with their logprobs) and two more to
    # force preemption
    again = llm.generate([prompt, prompt + " Why?", prompt + " How?"], params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert again[0].num_cached_tokens == 15  # its first block, read; the 16th token recomputed
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(first.prompt_token_ids) - 1
    # The same tokens, ranks and values; values up to float rounding: without the CPU kernels
    # (no AVX-512), torch's matmuls round differently for a different batch.
    assert len(again[0].prompt_logprobs) == len(first.prompt_logprobs)
    for ours, theirs in zip(again[0].prompt_logprobs, first.prompt_logprobs, strict=True):
        assert (ours.token_id, ours.rank) == (theirs.token_id, theirs.rank)
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
    assert again[0].outputs[0].token_ids == first.outputs[0].token_ids


def test_choices_scored_together_read_their_shared_context_from_the_cache():
    # An evaluation harness scores a question's choices as one request each, sent together, with
    # prompt logprobs (echo + logprobs): the context is computed once, the same numbers come back.
    context = (
        "Question: The keeper of the lighthouse climbed one hundred and twelve steps every evening, "
        "counting them as his father had taught him, and at the top he polished the great lens until "
        "it shone like still water. Which of these did he do next?\nAnswer:"
    )
    prompts = [context + choice for choice in (" He lit the lamp.", " He slept.", " He sang.", " He left.")]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    ours = LLM(dtype="float32").generate(prompts, params)
    theirs = LLM(dtype="float32", enable_prefix_caching=False).generate(prompts, params)
    ids = [out.prompt_token_ids for out in ours]
    shared = next(i for i, column in enumerate(zip(*ids, strict=False)) if len(set(column)) > 1)
    num_context_blocks = shared // 16
    assert num_context_blocks >= 2
    assert [out.num_cached_tokens for out in ours] == [0] + [16 * num_context_blocks - 1] * 3
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.prompt_logprobs is not None and reference.prompt_logprobs is not None
        assert len(mine.prompt_logprobs) == len(mine.prompt_token_ids) - 1
        for a, b in zip(mine.prompt_logprobs, reference.prompt_logprobs, strict=True):
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_constrained_outputs_follow_their_grammar_through_chunks_and_preemption():
    llm = LLM(dtype="float32", max_num_batched_tokens=16, num_kv_blocks=6)
    specs = {
        "json": _json(),
        "json_object": StructuredOutputs(json_object=True),
        "regex": StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"),
        "choice": StructuredOutputs(choice=("Paris", "London", "Rome")),
        "grammar": StructuredOutputs(grammar='root ::= "yes" | "no" | "maybe"'),
    }
    prompts = [
        "Describe a person as JSON:",
        "Write a JSON object:",
        "A phone number:",
        "The capital of France:",
    ]
    prompts.append("Is the sky blue?")
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=s) for s in specs.values()]
    filler = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)  # the pool runs dry
    outs = llm.generate([*prompts, "Tell me a story.", "Count to ten."], [*params, filler, filler])
    assert llm.engine.core.scheduler.num_preemptions > 0
    by_kind = dict(zip(specs, [o.outputs[0] for o in outs[: len(specs)]], strict=True))
    assert isinstance(json.loads(by_kind["json_object"].text), dict)
    person = json.loads(by_kind["json"].text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert by_kind["regex"].text[3] == "-" and len(by_kind["regex"].text) == 8
    assert by_kind["choice"].text in {"Paris", "London", "Rome"}
    assert by_kind["grammar"].text in {"yes", "no", "maybe"}
    for kind in ("json", "regex", "choice", "grammar"):
        assert by_kind[kind].finish_reason == "stop", kind  # the grammar ended it
    kv = llm.engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_penalties_min_tokens_and_logit_bias(llm: LLM, tokenizer):
    prompt = "1, 2, 3, 4,"
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    plain = llm.generate([prompt], greedy)[0].outputs[0]
    penalizing = SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=2.0)
    penalized = llm.generate([prompt], penalizing)[0].outputs[0]
    assert penalized.token_ids != plain.token_ids
    # frequency 2 makes a repeat of the same token no likelier than its logit minus 2 per use
    assert max(penalized.token_ids.count(t) for t in set(penalized.token_ids)) < max(
        plain.token_ids.count(t) for t in set(plain.token_ids)
    )
    eos = tokenizer.eos_token_id
    short = llm.generate(
        ["Say hi."], SamplingParams(max_tokens=64, temperature=0.0, logit_bias={eos: 100.0})
    )[0].outputs[0]
    assert short.token_ids == [eos] and short.finish_reason == "stop"
    held = SamplingParams(max_tokens=64, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=5)
    out = llm.generate(["Say hi."], held)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]


def test_penalized_requests_get_the_same_tokens_through_chunks_and_preemption(llm: LLM):
    # The runner keeps each penalized request's token counts across steps and rebuilds them from
    # the request's history when it comes back from preemption: the tokens are those of a run
    # with room for everything.
    penalized = [
        SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=0.8, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, presence_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.4, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),  # plain, beside them
    ]
    roomy = llm.generate(PROMPTS, penalized)
    tight = LLM(dtype="float32", max_num_batched_tokens=16, num_kv_blocks=8)
    crowded = tight.generate(PROMPTS, penalized)
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in crowded] == [o.outputs[0].token_ids for o in roomy]
    assert tight.engine.core.runner.rows.num_held <= len(PROMPTS)


def test_seeded_sampling_is_reproducible_whatever_shares_its_batch(llm: LLM):
    seeded = SamplingParams(max_tokens=10, temperature=1.0, min_p=0.05, presence_penalty=0.5, seed=11)
    alone = llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    crowd = [SamplingParams(max_tokens=10, temperature=0.8, structured_outputs=_json(), logprobs=2)] * 3
    mixed = llm.generate(PROMPTS[:1] + PROMPTS[1:], [seeded, *crowd])
    assert mixed[0].outputs[0].token_ids == alone


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs(json=json.dumps({"type": "strin"})), "Unsupported type"),
        (StructuredOutputs(json=json.dumps({"not": {"type": "string"}})), "'not' is not supported"),
        (StructuredOutputs(json=json.dumps({"$ref": "http://x/y.json"})), "only local references"),
        (StructuredOutputs(regex="[a-"), "cannot compile"),
        (StructuredOutputs(grammar='root ::= "a" |'), "cannot compile"),
    ],
)
def test_a_spec_that_cannot_be_enforced_is_refused_naming_the_field(llm: LLM, spec, message):
    with pytest.raises(ValueError, match=message) as raised:
        llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert raised.value.param == "structured_outputs"  # type: ignore[attr-defined]
    assert not llm.engine.has_unfinished_requests()


def test_an_aborted_constrained_request_frees_its_blocks_and_the_rest_go_on(llm: LLM):
    engine = llm.engine
    constrained = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=_json())
    request_id = engine.add_request("Describe a person as JSON:", constrained)
    other = engine.add_request("The capital of France is", SamplingParams(max_tokens=8, temperature=0.0))
    for _ in range(3):
        engine.step()
    assert engine.abort_request(request_id) is not None
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {other}
    kv = engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_offline_chat_with_tools_makes_the_named_call_its_schema_allows(llm: LLM):
    from common.structured_outputs import ToolCallGrammar
    from common.tool_parsers import parse_message

    weather = {"name": "get_weather", "parameters": {**SCHEMA, "properties": {"city": {"type": "string"}}}}
    weather["parameters"]["required"] = ["city"]
    grammar = ToolCallGrammar("hermes", json.dumps([weather]), "named", parallel=False)
    params = SamplingParams(
        max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputs(tool_calls=grammar)
    )
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    output = llm.chat(messages, params, tools=[{"type": "function", "function": weather}])[0].outputs[0]
    calls = parse_message(output.text, "hermes").tool_calls
    assert output.finish_reason == "stop" and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert set(json.loads(calls[0]["function"]["arguments"])) == {"city"}


def test_what_stops_a_request_is_in_its_text_only_with_include_stop_str_in_output(llm: LLM, tokenizer):
    """vLLM's semantics: a stop string and the stop token's text (stop_token_ids, eos) end the
    ids but not the text, unless include_stop_str_in_output; skip_special_tokens=False gives eos
    its text."""
    prompt = "1, 2, 3, 4,"
    plain = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    assert plain.text.startswith(" 5, 6")
    comma = tokenizer.encode(",")[0]
    for include in (False, True):
        params = SamplingParams(
            max_tokens=8, temperature=0.0, stop_token_ids=[comma], include_stop_str_in_output=include
        )
        out = llm.generate([prompt], params)[0].outputs[0]
        assert out.token_ids[-1] == comma and out.finish_reason == "stop"
        assert out.text == (" 5," if include else " 5")
        params = SamplingParams(
            max_tokens=8, temperature=0.0, stop=[" 6"], include_stop_str_in_output=include
        )
        out = llm.generate([prompt], params)[0].outputs[0]
        assert out.text == (" 5, 6" if include else " 5,") and out.finish_reason == "stop"
    eos = tokenizer.eos_token_id
    for skip in (True, False):
        params = SamplingParams(
            max_tokens=4, temperature=0.0, logit_bias={eos: 100.0}, skip_special_tokens=skip
        )
        ended = llm.generate(["Say hi."], params)[0].outputs[0]
        assert ended.token_ids == [eos] and ended.text == ""  # the stop token: never in the text
        params = dataclasses.replace(params, include_stop_str_in_output=True)
        ended = llm.generate(["Say hi."], params)[0].outputs[0]
        assert ended.text == ("" if skip else "<|im_end|>")
