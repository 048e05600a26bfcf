"""API keys, the body size limit and request limits, on an app deployed with them (real Ray)."""

from __future__ import annotations

import httpx
import openai
import pytest
from ray import serve

from deployments.app import AppArgs, build_app
from harness.serve_cluster import ServeCluster, delete_app

KEY = "sk-test-4f1c"


@pytest.fixture(scope="module")
def secured(serve_cluster: ServeCluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    key_file = tmp_path_factory.mktemp("keys") / "api_keys"
    key_file.write_text(f"# one key per line\n{KEY}\n")
    args = AppArgs(
        num_cpus=0,
        api_key_file=str(key_file),
        max_request_body_bytes=4096,
        engine={"kv_cache_bytes": 32 << 20, "max_model_len": 256},
    )
    serve.run(build_app(args), name="secured", route_prefix="/secured")
    yield f"{serve_cluster.base_url}/secured"
    delete_app("secured")


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {KEY}", KEY])
def test_requests_without_a_valid_key_get_401(secured: str, authorization: str | None):
    headers = {"Authorization": authorization} if authorization else {}
    # every route the app serves (its OpenAPI schema lists them), so a new one cannot skip the keys
    schema = httpx.get(f"{secured}/openapi.json", timeout=30).json()
    routes = [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops]
    assert ("GET", "/tokenizer_info") in routes and ("POST", "/v1/completions") in routes
    for method, path in routes:
        if path in ("/health", "/ping", "/version"):  # open, as a load balancer's probe needs
            continue
        response = httpx.request(
            method, f"{secured}{path}", json={"prompt": "hi"}, headers=headers, timeout=30
        )
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_valid_key_is_served_and_health_stays_open(secured: str):
    client = openai.OpenAI(base_url=f"{secured}/v1", api_key=KEY, max_retries=0)
    completion = client.completions.create(model="smollm2-135m-instruct", prompt="Hello", max_tokens=2)
    assert completion.usage.completion_tokens == 2
    info = httpx.get(f"{secured}/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert info.status_code == 200 and info.json()["eos_token"] == "<|im_end|>"
    assert httpx.get(f"{secured}/health", timeout=30).status_code == 200
    assert httpx.get(f"{secured}/ping", timeout=30).status_code == 200
    assert httpx.get(f"{secured}/version", timeout=30).status_code == 200


def test_oversized_body_gets_413(secured: str):
    body = {"prompt": "x" * 5000, "max_tokens": 1}
    response = httpx.post(
        f"{secured}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_too_many_stop_strings_get_400(secured: str):
    body = {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}
    response = httpx.post(
        f"{secured}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop"
