"""LoRA through the real Ray Serve app and the official `openai` client, as vLLM's and Ray Serve
LLM's users call it: one adapter listed in `lora_modules`, one found under `lora_root`, a third
loaded and unloaded at runtime. Adapters are real PEFT adapters (random weights, written by
`peft`); a served adapter's greedy answer must equal the offline engine's with that adapter."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import serve

from common.lora import LoRARequest
from deployments.app import AppArgs, build_app
from harness.lora_adapters import save_random_adapter
from harness.serve_cluster import ServeCluster, delete_app
from replica_engine import LLM, SamplingParams

BASE = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 8
ENGINE = {"dtype": "float32"}  # the app's engine and the offline one alike (greedy is then exact)
DEADLINE_S = 900  # a hang detector on a busy 2-core machine


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """a (listed), b and broken (under lora_root), c (loaded at runtime), wide (rank 32 > 16)."""
    tmp = tmp_path_factory.mktemp("lora")
    root = tmp / "root"
    made = {
        "a": save_random_adapter(hf_model, tmp / "a", seed=1),
        "b": save_random_adapter(hf_model, root / "b", seed=2, rank=4),
        "c": save_random_adapter(
            hf_model, tmp / "c", seed=3, target_modules=("q_proj", "o_proj", "down_proj")
        ),
        "root": root,
    }
    for name, change in (("broken", {"target_modules": ["q_proj", "lm_head"]}), ("wide", {"r": 32})):
        path = shutil.copytree(made["a"], (root if name == "broken" else tmp) / name)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, **change}))
        made[name] = path
    return made


@dataclass(frozen=True)
class Served:
    url: str  # the LoRA app's base URL
    offline: dict[str | None, str]  # the offline engine's answers (offline_answers)


@pytest.fixture(scope="module")
def served(serve_cluster: ServeCluster, adapters: dict[str, Path]) -> Iterator[Served]:
    args = AppArgs(
        num_cpus=0,
        engine=ENGINE,
        lora_modules=[f"a={adapters['a']}"],  # vLLM's list form
        lora_root=str(adapters["root"]),
        allow_runtime_lora_updating=True,
        sampling_defaults={"temperature": 0, "max_tokens": MAX_TOKENS},
    )
    app = build_app(args)
    try:
        with ThreadPoolExecutor(1) as pool:  # the offline engine runs while the replica starts
            deployed = pool.submit(serve.run, app, name="lora", route_prefix="/lora")
            offline = offline_answers(adapters)
            deployed.result()
        yield Served(f"{serve_cluster.base_url}/lora", offline)
    finally:
        delete_app("lora")


@pytest.fixture(scope="module")
def lora_url(served: Served) -> str:
    return served.url


@pytest.fixture(scope="module")
def offline(served: Served) -> dict[str | None, str]:
    return served.offline


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)


def offline_answers(adapters: dict[str, Path]) -> dict[str | None, str]:
    """The offline engine's greedy answers: the completion under the base model and each adapter,
    and the chat under a."""
    llm = LLM(enable_lora=True, **ENGINE)
    chat = llm.engine.chat_prompt_ids(CHAT, None)
    cases = {
        None: (None, PROMPT),
        "a": ("a", PROMPT),
        "b": ("b", PROMPT),
        "c": ("c", PROMPT),
        "chat a": ("a", chat),
    }
    params = [
        SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, lora=name and LoRARequest(name, str(adapters[name]))
        )
        for name, _ in cases.values()
    ]
    outputs = llm.generate([prompt for _, prompt in cases.values()], params)  # one batch, one call
    return {key: output.outputs[0].text for key, output in zip(cases, outputs, strict=True)}


def complete(client: openai.OpenAI, model: str) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)


def test_each_adapter_answers_as_the_offline_engine(client: openai.OpenAI, offline: dict[str | None, str]):
    models = [BASE, f"{BASE}:a", "b"]  # the base, Ray Serve LLM's form, vLLM's bare name
    with ThreadPoolExecutor(len(models)) as pool:  # one engine step mixes the three
        answers = list(pool.map(lambda model: complete(client, model), models))
    texts = [answer.choices[0].text for answer in answers]
    assert texts == [offline[None], offline["a"], offline["b"]]
    assert offline[None] not in (offline["a"], offline["b"])  # the adapters do change the answer
    assert [answer.model for answer in answers] == models  # each answers under the name it was called


def test_chat_streams_with_an_adapter(client: openai.OpenAI, offline: dict[str | None, str]):
    stream = client.chat.completions.create(
        model=f"{BASE}:a", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == offline["chat a"]


def test_models_lists_each_adapter_under_its_parent(client: openai.OpenAI, adapters: dict[str, Path]):
    cards = {card.id: card.model_dump() for card in client.models.list()}
    assert {BASE, "a", "b", "broken"} <= set(cards)
    assert cards[BASE]["parent"] is None and cards[BASE]["root"] == BASE
    assert cards["a"]["parent"] == BASE and cards["a"]["root"] == str(adapters["a"])
    assert cards["b"]["root"] == str(adapters["root"] / "b")
    # models.retrieve: the same card, by the adapter's name or as `<base>:name`
    assert (
        client.models.retrieve("a").model_dump()
        == client.models.retrieve(f"{BASE}:a").model_dump()
        == cards["a"]
    )


def test_an_adapter_loaded_at_runtime_serves_until_unloaded(
    lora_url: str, client: openai.OpenAI, adapters: dict[str, Path], offline: dict[str | None, str]
):
    load = {"lora_name": "c", "lora_path": str(adapters["c"])}
    loaded = httpx.post(f"{lora_url}/v1/load_lora_adapter", json=load, timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert "c" in {card.id for card in client.models.list()}
    assert complete(client, "c").choices[0].text == offline["c"]
    again = httpx.post(f"{lora_url}/v1/load_lora_adapter", json=load, timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    unloaded = httpx.post(f"{lora_url}/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError) as caught:
        complete(client, "c")
    assert caught.value.body["code"] == "model_not_found"
    gone = httpx.post(f"{lora_url}/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert gone.status_code == 404


def test_bad_adapters_and_names_are_refused_before_a_replica(
    lora_url: str, client: openai.OpenAI, adapters: dict[str, Path]
):
    for name, words in (("wide", "max_lora_rank"), ("broken", "lm_head")):
        load = {"lora_name": f"new-{name}", "lora_path": str(adapters[name])}
        refused = httpx.post(f"{lora_url}/v1/load_lora_adapter", json=load, timeout=60)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "lora_path" and error["code"] == "invalid_lora_adapter"
        assert words in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:  # under lora_root, but cannot run
        complete(client, "broken")
    assert caught.value.body["param"] == "model" and "lm_head" in caught.value.body["message"]
    for unknown in ("nope", f"{BASE}:nope", f"{BASE}:../a"):
        with pytest.raises(openai.NotFoundError) as caught:
            complete(client, unknown)
        assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="a", input="hello")
    assert caught.value.body["param"] == "model" and "LoRA adapter" in caught.value.body["message"]


def test_a_bad_deploy_names_the_setting(adapters: dict[str, Path]):
    """Checked when the app is built, before anything starts (no Ray needed)."""
    for fields, words in (
        ({"lora_modules": {"w": str(adapters["wide"])}}, "lora_modules: adapter 'w'"),
        ({"lora_modules": ["a=/nowhere"]}, "lora_modules: adapter 'a' at /nowhere: no adapter_config.json"),
        ({"lora_root": str(adapters["a"] / "adapter_config.json")}, "lora_root:"),
        ({"lora_root": str(adapters["root"]), "engine": {"enable_lora": False}}, "engine.enable_lora"),
    ):
        with pytest.raises(ValueError, match=words):
            AppArgs(**fields).engine_config()
    assert AppArgs(lora_root=str(adapters["root"])).engine_config().enable_lora


lora_fields = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=40))
lora_bodies = st.one_of(
    st.fixed_dictionaries(
        {
            "lora_name": st.text(max_size=20),
            "lora_path": st.sampled_from(["/", "/tmp", "."]) | st.text(max_size=40),
        },
        optional={"load_inplace": st.booleans()},
    ),
    st.dictionaries(st.sampled_from(["lora_name", "lora_path", "load_inplace", "lora_int_id"]), lora_fields),
    lora_fields,
)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=lora_bodies, route=st.sampled_from(["load", "unload"]))
def test_fuzzed_load_and_unload_never_get_a_5xx(lora_url: str, body: object, route: str):
    """Last in the module: a fuzzed unload may remove a listed adapter."""
    response = httpx.post(
        f"{lora_url}/v1/{route}_lora_adapter", content=json.dumps(body).encode(), timeout=60
    )
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
