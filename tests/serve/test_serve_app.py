"""End to end: serve_config.yaml on a real local Ray cluster, the real SmolLM2, the official
`openai` client and raw HTTP. One cluster per session (see conftest.serve_cluster)."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest
from ray._private.utils import read_ray_address

from common.finish_reason import FinishReason
from harness.metrics_scrape import ENGINE_PREFIX, scrape
from harness.replicas import engine_stats
from harness.serve_cluster import ServeCluster, wait_for
from replica_engine import LLM, SamplingParams
from replica_engine.metrics.engine_metrics import REASON_LABEL
from tests.engine.engine_idle import wait_idle

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FINISHED = f"{ENGINE_PREFIX}requests_finished_total"


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve_cluster.base_url}/v1", api_key="unused", max_retries=0)


def test_models_and_health(serve_cluster: ServeCluster, client: openai.OpenAI):
    assert [m.id for m in client.models.list()] == [MODEL]
    (card,) = httpx.get(f"{serve_cluster.base_url}/v1/models").json()["data"]
    assert card["max_model_len"] == 8192  # vLLM's: SmolLM2's context (serve_config.yaml sets none)
    assert client.models.retrieve(MODEL).model_dump() == client.models.list().data[0].model_dump()
    assert client.models.retrieve("HuggingFaceTB/SmolLM2-135M-Instruct").id == MODEL  # an alias: its card
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    version = httpx.get(f"{serve_cluster.base_url}/version", timeout=30)
    assert version.status_code == 200 and version.json() == {"version": "0.1.0"}
    # its hub id names it too (not listed): a client written for `vllm serve <hub id>` works as is
    hub = client.completions.create(model="HuggingFaceTB/SmolLM2-135M-Instruct", prompt="Hi", max_tokens=1)
    assert hub.model == "HuggingFaceTB/SmolLM2-135M-Instruct" and hub.usage.completion_tokens == 1
    assert httpx.get(f"{serve_cluster.base_url}/health").status_code == 200
    assert httpx.get(f"{serve_cluster.base_url}/ping").status_code == 200  # vLLM's name for it
    assert httpx.post(f"{serve_cluster.base_url}/ping").status_code == 200


def test_the_test_cluster_is_not_the_one_a_users_ray_init_finds(serve_cluster: ServeCluster):
    """`ray start` records its address in its temp dir's ray_current_cluster, which `ray.init()`
    and `serve run` attach to: a test cluster keeps its own, so `make serve` after `make test`
    does not wait for ever on a cluster the tests ended (seen on 2026-11-28)."""
    assert read_ray_address() != serve_cluster.ray_address  # /tmp/ray's: what a user's driver reads


def test_the_readme_request_answers_paris(serve_cluster: ServeCluster):
    """No sampling fields: serve_config.yaml's sampling_defaults (greedy, 256 tokens) apply."""
    body = {"model": MODEL, "messages": QUESTION}
    response = httpx.post(f"{serve_cluster.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."


@pytest.fixture(scope="module")
def served_llm() -> LLM:
    """An offline engine with serve_config.yaml's engine settings that decide outputs: the default
    dtype (`auto`: bf16 on CPUs with native bf16, as this project's machines have)."""
    return LLM(num_kv_blocks=64)


def test_chat_and_completion_match_the_offline_engine(client: openai.OpenAI, served_llm: LLM):
    llm = served_llm
    params = SamplingParams(max_tokens=24, temperature=0.0)
    offline_chat = llm.chat(QUESTION, params)[0]
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == offline_chat.outputs[0].text
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == offline_chat.outputs[0].finish_reason
    assert chat.usage.prompt_tokens == len(offline_chat.prompt_token_ids)
    assert chat.usage.completion_tokens == len(offline_chat.outputs[0].token_ids)

    prompt = "The capital of France is"
    offline = llm.generate(prompt, params)[0]
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert completion.choices[0].text == offline.outputs[0].text
    assert completion.usage.total_tokens == len(offline.prompt_token_ids) + len(offline.outputs[0].token_ids)


def test_embeddings_match_the_offline_engine(client: openai.OpenAI, served_llm: LLM):
    """The replica pools from its own forward as the offline engine does (the same settings: bf16
    here, the GGUF's blocks), so the vectors agree to float32 rounding. The client asks for
    base64 unless told (and decodes it); the float form carries the same values."""
    inputs = ["Embeddings for a keeper of lighthouses.", "A second input, answered in order."]
    offline = served_llm.embed(inputs)
    answer = client.embeddings.create(model=MODEL, input=inputs)
    assert [data.index for data in answer.data] == [0, 1]
    for data, expected in zip(answer.data, offline, strict=True):
        assert max(abs(a - b) for a, b in zip(data.embedding, expected.embedding, strict=True)) <= 1e-4
    num_tokens = sum(len(out.prompt_token_ids) for out in offline)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == num_tokens
    floats = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float", dimensions=576)
    assert [data.embedding for data in floats.data] == [data.embedding for data in answer.data]


def test_stream_concatenates_to_the_whole_answer(client: openai.OpenAI):
    settings = {"model": MODEL, "messages": QUESTION, "max_tokens": 20, "temperature": 0}
    whole = client.chat.completions.create(**settings)
    chunks = list(
        client.chat.completions.create(**settings, stream=True, stream_options={"include_usage": True})
    )
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1
    assert "".join(content) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: 0 the first time
    assert [getattr(chunks[-1].usage, n) for n in counts] == [getattr(whole.usage, n) for n in counts]
    # vLLM's chat_template_kwargs reach the template (SmolLM2's ignores a variable it does not use)
    kwargs = client.chat.completions.create(
        **settings, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert kwargs.choices[0].message.content == whole.choices[0].message.content


def test_stop_string_cuts_the_output(client: openai.OpenAI):
    completion = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0, stop=["."]
    )
    assert completion.choices[0].text == " Paris"
    assert completion.choices[0].finish_reason == "stop"


def test_vllm_fields_for_the_prompt_the_stop_and_the_grammar_are_honoured(
    serve_cluster: ServeCluster, client: openai.OpenAI
):
    """continue_final_message: the model continues the assistant's prefill, whose prompt is what
    /tokenize renders; include_stop_str_in_output keeps the stop string; vLLM's older guided_choice
    constrains (vLLM itself now ignores it)."""
    prefill = [
        {"role": "user", "content": "Count from 1 to 9."},
        {"role": "assistant", "content": "1, 2, 3,"},
    ]
    options = {"continue_final_message": True, "add_generation_prompt": False}
    continued = client.chat.completions.create(
        model=MODEL, messages=prefill, max_tokens=4, temperature=0, extra_body=options
    )
    rendered = httpx.post(
        f"{serve_cluster.base_url}/tokenize",
        json={"model": MODEL, "messages": prefill, **options},
        timeout=60,
    ).json()
    assert continued.usage.prompt_tokens == rendered["count"]
    assert continued.choices[0].message.content.startswith(" 4,")
    stop = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 16,
        "temperature": 0,
        "stop": ["."],
    }
    kept = client.completions.create(**stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " Paris."
    chosen = client.completions.create(
        model=MODEL, prompt="Is the sky blue?", max_tokens=5, extra_body={"guided_choice": ["maybe", "never"]}
    )
    assert chosen.choices[0].text in ("maybe", "never")


def test_n_choices_and_a_batch_of_prompts(client: openai.OpenAI):
    completion = client.completions.create(
        model=MODEL,
        prompt=["Once upon a time", "The best way to cook rice is"],
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in completion.choices) == [0, 1, 2, 3]
    assert completion.usage.completion_tokens == 4 * 8
    assert completion.choices[0].text != completion.choices[1].text  # seeded choices still differ


def test_sixteen_concurrent_streams_complete(serve_cluster: ServeCluster):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Request {i}: count from one to ten.",
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish, tokens = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    async def run_all() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=f"{serve_cluster.base_url}/v1", api_key="unused") as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    assert asyncio.run(run_all()) == [("length", 16)] * 16


def test_client_disconnect_aborts_and_frees_the_request(serve_cluster: ServeCluster):
    aborted = {"application": serve_cluster.app_name, REASON_LABEL: FinishReason.ABORT.value}
    aborts_before = scrape(serve_cluster, FINISHED, aborted)
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{serve_cluster.base_url}/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")]
        assert received
        busy = engine_stats(serve_cluster.app_name)
        assert busy.num_running == 1 and busy.num_free_blocks < busy.num_total_blocks
    # The connection is closed here, mid-stream: the engine ends the request as aborted (not run
    # on to its 2,000 tokens) and lets go of its blocks.
    wait_for(lambda: scrape(serve_cluster, FINISHED, aborted) > aborts_before, "the request is aborted")
    wait_idle(lambda: engine_stats(serve_cluster.app_name))


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
BAD_REQUESTS = [
    # (path, raw body, status, param, code)
    (CHAT, {"model": MODEL}, 400, "messages", None),
    (CHAT, {"messages": []}, 400, "messages", None),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages", None),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", None),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", None),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    (COMPLETIONS, {"prompt": "hi", "top_p": 2}, 400, "top_p", None),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n", None),
    (COMPLETIONS, {"prompt": "hi", "stop": 3}, 400, "stop", None),
    (COMPLETIONS, {"prompt": "hi", "seed": 2**64}, 400, "seed", None),
    (COMPLETIONS, {"prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty", None),
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": -3}, 400, "presence_penalty", None),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    (COMPLETIONS, {"prompt": "hi", "min_p": 1.5}, 400, "min_p", None),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", None),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"hi": 1}}, 400, "logit_bias", None),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"1": 101}}, 400, "logit_bias", None),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias", None),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", None),
    (COMPLETIONS, {"prompt": "hi", "priority": "high"}, 400, "priority", None),
    (CHAT, {"messages": QUESTION, "top_logprobs": 3}, 400, "top_logprobs", None),
    (CHAT, {"messages": QUESTION, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs", None),
    (CHAT, {"messages": QUESTION, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", None),
    (CHAT, {"messages": QUESTION, "response_format": {"type": "xml"}}, 400, "response_format", None),
    (CHAT, {"messages": QUESTION, "response_format": {"type": "json_schema"}}, 400, "response_format", None),
    (
        CHAT,
        {
            "messages": QUESTION,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            },
        },
        400,
        "response_format",
        None,
    ),
    (
        CHAT,
        {
            "messages": QUESTION,
            "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a+"},
        },
        400,
        "structured_outputs",
        None,
    ),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"regex": "[a-"}}, 400, "structured_outputs", None),
    (
        COMPLETIONS,
        {"prompt": "hi", "structured_outputs": {"json": {"not": {}}}},
        400,
        "structured_outputs",
        None,
    ),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {}}, 400, "structured_outputs", None),
    (COMPLETIONS, {"prompt": "hi", "guided_regex": "[a-"}, 400, "guided_regex", None),
    (COMPLETIONS, {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search", None),
    (CHAT, {"messages": QUESTION, "continue_final_message": True}, 400, "continue_final_message", None),
    (CHAT, {"messages": QUESTION, "chat_template": "{{ messages }}"}, 400, "chat_template", None),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"choice": []}}, 400, "structured_outputs", None),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": "hello " * 9000}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 9000}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    (EMBEDDINGS, {"input": "hi", "dimensions": 64}, 400, "dimensions", None),
    (EMBEDDINGS, {"input": [""]}, 400, "input", None),
    (EMBEDDINGS, {"input": "hello " * 9000}, 400, "input", "context_length_exceeded"),
    (EMBEDDINGS, {"input": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    (COMPLETIONS, '{"prompt": "hi"', 400, None, None),  # malformed JSON
    (COMPLETIONS, "[1, 2]", 400, None, None),  # not an object
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_REQUESTS)
def test_bad_request_gets_an_openai_error_and_the_server_carries_on(
    serve_cluster: ServeCluster, path: str, body: object, status: int, param: str | None, code: str | None
):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{serve_cluster.base_url}{path}", content=content, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    ok = httpx.post(
        f"{serve_cluster.base_url}{COMPLETIONS}", json={"prompt": "hi", "max_tokens": 1}, timeout=30
    )
    assert ok.status_code == 200, ok.text


def test_unknown_route_is_an_openai_404(serve_cluster: ServeCluster):
    response = httpx.get(f"{serve_cluster.base_url}/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_default_max_tokens_fits_the_room_the_prompt_leaves(small_app: str):
    # 124 prompt tokens + the server's default of 256 would not fit in the 128-token KV pool (nor
    # the 160-token context): the default shrinks to what fits.
    body = {"prompt": [1] * 124, "ignore_eos": True}
    response = httpx.post(f"{small_app}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def test_full_queue_gets_503_with_retry_after(small_app: str):
    # The small app's replica holds 4 requests and queues 1 more: of 8 at once, some are refused.
    body = {"prompt": "Count to ten.", "max_tokens": 48, "ignore_eos": True}

    async def answers_in_order() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as http:
            posts = [http.post(f"{small_app}/v1/completions", json=body) for _ in range(8)]
            return [await answer for answer in asyncio.as_completed(posts)]

    responses = asyncio.run(answers_in_order())
    statuses = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code == 503]
    assert refused and len(refused) < len(responses), statuses
    # Refused at once, not after waiting for a place: every refusal is answered before any
    # accepted request finishes (each runs 48 steps on a pool that holds two of them at a time).
    assert statuses == [503] * len(refused) + [200] * (len(responses) - len(refused)), statuses
    for response in refused:
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"] == "overloaded"


def test_a_repeated_chat_reuses_its_prompt_from_the_prefix_cache(serve_cluster: ServeCluster, client):
    hits = "ray_stallfree_prefix_cache_hits_total"
    hits_before = scrape(serve_cluster, hits, {"application": serve_cluster.app_name})
    # A system prompt of ~600 tokens no other test sends (the nonce comes first).
    system = f"Session {uuid.uuid4().hex}. " + "You answer questions about lighthouses, briefly. " * 60
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who keeps the lamp?"}]

    def stream_once() -> openai.types.CompletionUsage:
        usage = None
        for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True}
        ):
            usage = chunk.usage or usage
        return usage

    first, second = stream_once(), stream_once()
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    assert first.prompt_tokens - 16 <= cached < first.prompt_tokens and cached % 16 == 0
    unstreamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4).usage
    assert unstreamed.prompt_tokens_details.cached_tokens == cached
    wait_for(
        lambda: (
            scrape(serve_cluster, hits, {"application": serve_cluster.app_name}) >= hits_before + 2 * cached
        ),
        "prefix cache hits counted",
    )


def test_return_token_ids_gives_the_prompts_and_the_answers_ids_as_vllm_does(serve_cluster: ServeCluster):
    """Completions: each choice its prompt's ids and its own; chat: the prompt's once, beside the
    choices. Streamed, the prompt's come in the first chunk (of each choice), and the chunks' ids
    join up to the whole answer's."""
    url = serve_cluster.base_url

    def ids_of(body: dict[str, object]) -> list[int]:
        return httpx.post(f"{url}/tokenize", json=body, timeout=30).json()["tokens"]

    def streamed(path: str, body: dict[str, object]) -> list[dict]:
        with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as reply:
            lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: {")]
        return [json.loads(line) for line in lines]

    prompts = ["The capital of France is", "One, two,"]
    body = {
        "model": MODEL,
        "prompt": prompts,
        "n": 2,
        "max_tokens": 5,
        "temperature": 0,
        "return_token_ids": True,
    }
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == ids_of({"prompt": prompts[choice["index"] // 2]})
        assert len(choice["token_ids"]) == 5
    chunks = streamed("/v1/completions", body)
    for choice in whole["choices"]:
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == choice["index"]]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]

    chat_body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 5,
        "temperature": 0,
        "return_token_ids": True,
    }
    chat = httpx.post(f"{url}/v1/chat/completions", json=chat_body, timeout=120).json()
    assert chat["prompt_token_ids"] == ids_of({"messages": QUESTION})
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    chunks = streamed("/v1/chat/completions", chat_body)
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    assert [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids", [])] == chat[
        "choices"
    ][0]["token_ids"]
