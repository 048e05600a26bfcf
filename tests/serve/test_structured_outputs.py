"""Structured outputs, logprobs, penalties and priority through the real app (serve_config.yaml,
SmolLM2) and the official `openai` client, as users of vLLM call them."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from ray import serve

from harness.pydantic_schemas import SCHEMAS, SYSTEM
from harness.serve_cluster import ServeCluster

MODEL = "smollm2-135m-instruct"
# A hang detector for waits on the replica's state and for requests: twenty constrained requests at
# once took up to 10 minutes beside two busy processes (~15 s on an idle machine).
STATE_DEADLINE_S = 1800


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{serve_cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=STATE_DEADLINE_S
    )


def test_parse_returns_a_valid_object_for_twenty_pydantic_schemas(client: openai.OpenAI):
    def parse(case):
        model, prompt = case
        return client.chat.completions.parse(
            model=MODEL,
            messages=[SYSTEM, {"role": "user", "content": prompt}],
            response_format=model,
            max_tokens=200,
            temperature=0,
        )

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # all at once: the engine batches them
        completions = list(pool.map(parse, SCHEMAS))
    for (model, _), completion in zip(SCHEMAS, completions, strict=True):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, model)
        assert model.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_json_object_regex_choice_and_grammar_are_honoured(client: openai.OpenAI):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[SYSTEM, {"role": "user", "content": "Give the name and age of a cat called Tom, aged 3."}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    cases = [
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
        ({"choice": ["Paris", "Rome", "Berlin"]}, lambda text: text in {"Paris", "Rome", "Berlin"}),
        ({"grammar": 'root ::= "yes" | "no"'}, lambda text: text in {"yes", "no"}),
    ]
    for spec, holds in cases:
        completion = client.completions.create(
            model=MODEL,
            prompt="The capital of France is",
            max_tokens=20,
            temperature=0.7,
            extra_body={"structured_outputs": spec},
        )
        text = completion.choices[0].text
        assert holds(text), (spec, text)
        assert completion.choices[0].finish_reason == "stop"


def test_chat_logprobs_streamed_and_whole(serve_cluster: ServeCluster, client: openai.OpenAI):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(  # 6 tokens: not yet at the end-of-turn token
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    assert "".join(entry.token for entry in content) == whole.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes) == entry.token.encode()
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        entry
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # vLLM's prompt_logprobs on chat: once, beside the choices
    body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 1}
    raw = httpx.post(f"{serve_cluster.base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert raw["prompt_logprobs"][0] is None and len(raw["prompt_logprobs"]) == raw["usage"]["prompt_tokens"]
    assert all(1 <= len(entry) <= 2 for entry in raw["prompt_logprobs"][1:])


def test_completion_echo_with_logprobs_scores_the_prompt(serve_cluster: ServeCluster, client: openai.OpenAI):
    prompt = "The capital of France is"
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    choice = completion.choices[0]
    logprobs = choice.logprobs
    num_prompt = completion.usage.prompt_tokens
    assert choice.text.startswith(prompt) and len(logprobs.tokens) == num_prompt + 3
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value <= 0 for value in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    for token, value, top in zip(
        logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
    ):
        assert top[token] == pytest.approx(value) and 2 <= len(top) <= 3
    # vLLM's prompt_logprobs: the same numbers, by token id
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    raw = httpx.post(f"{serve_cluster.base_url}/v1/completions", json=body, timeout=60).json()
    prompt_logprobs = raw["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == num_prompt
    scored = [next(iter(entry.values()))["logprob"] for entry in prompt_logprobs[1:]]
    assert scored == pytest.approx(logprobs.token_logprobs[1:num_prompt], abs=1e-3)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(serve_cluster: ServeCluster, client: openai.OpenAI):
    """As OpenAI's legacy API and vLLM: the prompt comes back with its logprobs, and nothing
    generated (how evaluation harnesses score a text); the same numbers as echo with a token."""
    prompts = ["The capital of France is", "Two plus two"]
    scored = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, logprobs=1, echo=True)
    one_more = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, logprobs=1, echo=True)
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == one_more.usage.prompt_tokens
    for prompt, choice, longer in zip(prompts, scored.choices, one_more.choices, strict=True):
        assert choice.text == prompt and choice.finish_reason == "length"
        assert choice.logprobs.tokens == longer.logprobs.tokens[:-1]
        assert choice.logprobs.token_logprobs == pytest.approx(longer.logprobs.token_logprobs[:-1], abs=1e-3)
    stream = client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=0, logprobs=1, echo=True, stream=True
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert "".join(c.text for c in chunks) == prompts[0] and chunks[-1].finish_reason == "length"
    assert [t for c in chunks for t in c.logprobs.tokens] == scored.choices[0].logprobs.tokens
    refused = httpx.post(
        f"{serve_cluster.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 0}, timeout=60
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_penalties_change_the_output(client: openai.OpenAI):
    def complete(**fields) -> str:
        return (
            client.completions.create(
                model=MODEL, prompt="Say yes five times:", max_tokens=16, temperature=0, **fields
            )
            .choices[0]
            .text
        )

    plain = complete()
    assert complete(frequency_penalty=2.0) != plain
    assert complete(presence_penalty=2.0) != plain
    assert complete(extra_body={"repetition_penalty": 2.0}) != plain
    assert complete(frequency_penalty=0.0, presence_penalty=0.0) == plain


def test_under_a_full_pool_the_urgent_request_is_admitted_first(small_app: str):
    """small_app's pool (8 blocks) holds one of these requests at a time (100 prompt tokens: 7
    blocks, 8 with their output). The replica is paused, so that the requests wait together
    however slow the host: two less urgent ones (one HTTP request, n=2: the replica holds 4 calls,
    these stats polls among them), then an urgent one, each state awaited on the replica's stats,
    one request at a time (two arriving at once could overflow small_app's queue of 1). On resume
    the order they are admitted in is the scheduler's alone: the urgent one runs first (with FCFS
    it would run last). Distinct token ids: no prompt shares another's blocks."""
    replica = serve.get_deployment_handle("EngineReplica", app_name="small")
    finished: list[str] = []

    async def run(name: str, token_id: int, priority: int, **settings: int):
        body = {
            "prompt": [token_id] * 100,
            "max_tokens": 20,
            "ignore_eos": True,
            "temperature": 0,
            "priority": priority,
            **settings,
        }
        async with httpx.AsyncClient(timeout=STATE_DEADLINE_S) as http:
            response = await http.post(f"{small_app}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        finished.append(name)

    async def until(what: str, predicate) -> None:
        """A deadline on state, sized for a loaded 2-core machine (a hang detector)."""
        deadline = asyncio.get_running_loop().time() + STATE_DEADLINE_S
        while not predicate(await replica.stats.remote()):
            assert asyncio.get_running_loop().time() < deadline, f"not within {STATE_DEADLINE_S} s: {what}"
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        await replica.pause.remote()
        try:
            background = asyncio.create_task(run("background", 2000, 5, n=2))
            await until("both background choices wait", lambda s: s.num_waiting == 2)
            urgent = asyncio.create_task(run("urgent", 3000, -5))
            await until("the urgent request waits", lambda s: s.num_waiting == 3)
        finally:
            await replica.resume.remote()
        await asyncio.gather(background, urgent)

    asyncio.run(scenario())
    beyond = httpx.post(f"{small_app}/v1/completions", json={"prompt": "hi", "priority": -11}, timeout=60)
    assert beyond.status_code == 400 and beyond.json()["error"]["param"] == "priority"  # max_priority 10
    assert finished == ["urgent", "background"]
