"""vLLM's /tokenize, /detokenize and /tokenizer_info: the answers straight from
deployments.tokenize_api with the Ingress's PromptProcessor (no Ray), then over HTTP on the
session's shared app, where the counts must equal what the completion and chat endpoints report as
prompt_tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest
from transformers import AutoTokenizer

from common.model_source import DEFAULT_MODEL, resolve_model
from common.prompts import PromptProcessor
from common.tokenizer import PromptTokenizer
from deployments import tokenize_api
from deployments.protocol import ApiError
from harness.serve_cluster import ServeCluster

TEXTS = [
    "Hello, world.",
    "naïve café — 東京 🚀",
    "  two leading spaces,\n\ttab, trailing  \n",
    "<|im_start|>user",
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PREFILL = [*QUESTION, {"role": "assistant", "content": "The capital of France is "}]


@pytest.fixture(scope="module")
def prompts() -> PromptProcessor:
    """What the shared app's Ingress loads (serve_config.yaml sets no max_model_len)."""
    return PromptProcessor.load(resolve_model(DEFAULT_MODEL))


def tokenize(prompts: PromptProcessor, body: dict[str, Any]) -> tokenize_api.TokenizeResponse:
    return tokenize_api.tokenize(prompts, tokenize_api.parse_tokenize(json.dumps(body).encode()))


def detokenize(prompts: PromptProcessor, tokens: list[int]) -> str:
    return tokenize_api.detokenize(prompts, tokenize_api.DetokenizeRequest(tokens=tokens)).prompt


def test_text_tokenizes_as_the_completion_endpoint_does(prompts: PromptProcessor, model_dir: Path):
    theirs = AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        answer = tokenize(prompts, {"prompt": text, "return_token_strs": True})
        assert answer.tokens == prompts.tokenize(text) and answer.count == len(answer.tokens)
        assert answer.max_model_len == prompts.max_model_len == 8192
        assert answer.token_strs == theirs.convert_ids_to_tokens(answer.tokens)
        plain = tokenize(prompts, {"prompt": text, "add_special_tokens": False})
        assert plain.tokens == theirs.encode(text, add_special_tokens=False) and plain.token_strs is None
        assert detokenize(prompts, answer.tokens) == text == theirs.decode(answer.tokens)


def test_chat_tokenizes_as_the_chat_endpoint_does(prompts: PromptProcessor):
    text, ids = prompts.chat_prompt(QUESTION)
    assert tokenize(prompts, {"messages": QUESTION}).tokens == ids
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital "},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    assert tokenize(prompts, {"messages": parts}).tokens == ids
    assert detokenize(prompts, ids) == text  # special tokens kept, as vLLM's /detokenize keeps them


TRIMMING_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}"


@pytest.mark.parametrize("template", [None, TRIMMING_TEMPLATE], ids=["smollm2", "trimming"])
@pytest.mark.parametrize(
    ("add_generation_prompt", "continue_final_message"), [(True, False), (False, False), (False, True)]
)
def test_chat_options_render_as_transformers_does(
    model_dir: Path,
    tmp_path: Path,
    template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
):
    if template is not None:  # SmolLM2's tokenizer with another chat template
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (tmp_path / name).symlink_to(model_dir / name)
        (tmp_path / "chat_template.jinja").write_text(template)
    ours = PromptTokenizer.load(model_dir if template is None else tmp_path)
    options = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        PREFILL, chat_template=template, tokenize=False, **options
    )
    prompts = PromptProcessor(ours, vocab_size=49152, max_model_len=8192)
    answer = tokenize(prompts, {"messages": PREFILL, **options})
    assert answer.tokens == ours.encode(expected, add_special_tokens=False)
    assert detokenize(prompts, answer.tokens) == expected


def test_tokenizer_info_is_what_transformers_loads(model_dir: Path, tmp_path: Path):
    theirs = AutoTokenizer.from_pretrained(model_dir)
    info = tokenize_api.tokenizer_info(PromptProcessor.load(resolve_model(DEFAULT_MODEL)))
    assert info["tokenizer_class"] == type(theirs).__name__
    assert info["chat_template"] == theirs.chat_template
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert info[name] == getattr(theirs, name), name
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    json.dumps(info)  # every value as JSON writes it (AddedToken dicts as their text)
    # a served chat_template (the model setting) is the one reported
    served = PromptTokenizer.load(model_dir, chat_template=TRIMMING_TEMPLATE)
    assert served.settings["chat_template"] == TRIMMING_TEMPLATE
    # tokens written as AddedToken dicts, as some models' tokenizer_config writes them, as text
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|im_end|>", "special": True, "lstrip": False}
    config["additional_special_tokens"] = [{"content": "<|im_start|>", "special": True}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").symlink_to(model_dir / "tokenizer.json")
    settings = PromptTokenizer.load(tmp_path).settings
    assert (settings["eos_token"], settings["additional_special_tokens"]) == ("<|im_end|>", ["<|im_start|>"])


def test_a_model_without_a_tokenizer_gets_400(prompts: PromptProcessor):
    dummy = PromptProcessor.load(resolve_model("dummy:tiny-llama"))
    calls = (
        lambda: tokenize(dummy, {"prompt": "hi"}),
        lambda: detokenize(dummy, [1, 2]),
        lambda: tokenize_api.tokenizer_info(dummy),
    )
    for call in calls:
        with pytest.raises(ApiError) as error:
            call()
        assert error.value.status == 400 and error.value.body["error"]["param"] == "model"
        assert "no tokenizer" in str(error.value)


QUESTION_BODY = {"messages": QUESTION}
BAD_REQUESTS = [
    # (path, raw body, status, param)
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/tokenize", {**QUESTION_BODY, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {**QUESTION_BODY, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", '{"prompt": "hi"', 400, None),  # malformed JSON
    ("/tokenize", "[1, 2]", 400, None),  # not an object
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),  # past SmolLM2's vocabulary
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model"),
]


def test_tokenize_counts_what_the_endpoints_count(serve_cluster: ServeCluster, prompts: PromptProcessor):
    url = serve_cluster.base_url
    for body, endpoint in (
        ({"prompt": "The capital of France is"}, "/v1/completions"),
        (QUESTION_BODY, "/v1/chat/completions"),
    ):
        answer = httpx.post(f"{url}/tokenize", json={"model": DEFAULT_MODEL, **body}, timeout=30)
        assert answer.status_code == 200, answer.text
        tokenized = answer.json()
        assert set(tokenized) == {"count", "max_model_len", "tokens", "token_strs"}
        assert tokenized["max_model_len"] == prompts.max_model_len and tokenized["token_strs"] is None
        assert tokenized == tokenize(prompts, body).model_dump()
        served = httpx.post(f"{url}{endpoint}", json={**body, "max_tokens": 1}, timeout=60)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["prompt_tokens"] == tokenized["count"]
    text = TEXTS[1]
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens}, timeout=30).json() == {"prompt": text}


def test_tokenizer_info_serves_what_a_remote_tokenizer_needs(
    serve_cluster: ServeCluster, prompts: PromptProcessor, model_dir: Path
):
    """lm-eval's remote tokenizer (tokenizer_backend=remote, which it picks on its own where the
    server answers /tokenizer_info with an eos_token): the end-of-text id it reads is the first id
    /tokenize gives that token, and --apply_chat_template renders the served template with jinja2."""
    url = serve_cluster.base_url
    answer = httpx.get(f"{url}/tokenizer_info", timeout=30)
    assert answer.status_code == 200, answer.text
    info = answer.json()
    assert info == tokenize_api.tokenizer_info(prompts)
    eos = httpx.post(f"{url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"][0] == AutoTokenizer.from_pretrained(model_dir).eos_token_id
    rendered = (
        jinja2.Environment()
        .from_string(info["chat_template"])
        .render(messages=QUESTION, add_generation_prompt=True)
    )
    assert rendered == prompts.chat_prompt(QUESTION)[0]
    assert httpx.get(f"{url}/tokenizer_info", params={"model": DEFAULT_MODEL}, timeout=30).json() == info
    missing = httpx.get(f"{url}/tokenizer_info", params={"model": "gpt-4"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_bad_tokenize_requests_get_openai_errors(serve_cluster: ServeCluster):
    wrong = []
    for path, body, status, param in BAD_REQUESTS:
        content = body if isinstance(body, str) else json.dumps(body)
        response = httpx.post(f"{serve_cluster.base_url}{path}", content=content, timeout=30)
        error = response.json().get("error", {})
        if response.status_code != status or error.get("param") != param or not error.get("message"):
            wrong.append((path, body, response.status_code, response.text))
    assert not wrong
