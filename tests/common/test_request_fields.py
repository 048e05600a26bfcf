"""vLLM's request fields beyond OpenAI's, without a server: each is honoured, or refused with a 400
naming it unless given at its no-op value; none is silently dropped."""

from __future__ import annotations

import json

import pytest

from common.errors import InvalidRequestError
from common.model_source import DEFAULT_MODEL, resolve_model
from common.prompts import PromptProcessor
from common.structured_outputs import StructuredOutputs
from deployments.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_body

USER = [{"role": "user", "content": "Count to five."}]


def completion(**fields) -> CompletionRequest:
    return parse_body(CompletionRequest, json.dumps({"prompt": "Hi", **fields}).encode())


def chat(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, json.dumps({"messages": USER, **fields}).encode())


def refused(make, **fields) -> ApiError | InvalidRequestError:
    with pytest.raises((ApiError, InvalidRequestError)) as raised:
        make(**fields).sampling({})
    return raised.value


def param(error: ApiError | InvalidRequestError) -> str | None:
    return error.body["error"]["param"] if isinstance(error, ApiError) else error.param


@pytest.mark.parametrize(
    ("name", "value", "kind"),
    [
        ("guided_json", {"type": "object"}, "json"),
        ("guided_json", '{"type": "object"}', "json"),
        ("guided_regex", "[0-9]{3}", "regex"),
        ("guided_choice", ["yes", "no"], "choice"),
        ("guided_grammar", 'root ::= "a"', "grammar"),
    ],
)
@pytest.mark.parametrize("make", [completion, chat])
def test_guided_fields_constrain_as_structured_outputs_does(make, name: str, value, kind: str):
    """vLLM 0.12 dropped guided_* and ignores them (unconstrained output); here each is the
    structured_outputs kind it always meant, and its errors name it."""
    spec = make(**{name: value}).sampling({})["structured_outputs"]
    assert isinstance(spec, StructuredOutputs) and spec.param == name
    assert spec == make(structured_outputs={kind: value}).sampling({})["structured_outputs"]
    assert param(refused(make, **{name: "" if kind != "choice" else []})) == name


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_regex": "a", "guided_choice": ["a"]},
        {"guided_regex": "a", "structured_outputs": {"regex": "b"}},
        {"guided_regex": "a", "response_format": {"type": "json_object"}},
    ],
)
def test_two_ways_to_constrain_one_request_are_refused(fields: dict):
    error = refused(chat, **fields)
    assert "not several" in str(error) and param(error) in fields


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("use_beam_search", True),
        ("length_penalty", 0.5),
        ("allowed_token_ids", [1, 2]),
        ("bad_words", ["no"]),
        ("truncate_prompt_tokens", 8),
        ("spaces_between_special_tokens", False),
        ("return_tokens_as_token_ids", True),
        ("chat_template", "{{ messages }}"),
        ("documents", [{"text": "x"}]),
        ("logits_processors", ["x"]),
        ("vllm_xargs", {"a": 1}),
        ("guided_whitespace_pattern", " "),
    ],
)
def test_vllm_fields_not_implemented_are_refused_unless_no_op(name: str, value):
    with pytest.raises(ApiError) as raised:
        chat(**{name: value})
    assert raised.value.status == 400 and param(raised.value) == name
    no_op = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": []}
    chat(**{name: no_op.get(name)})  # at its no-op value (or null): accepted


def test_stop_and_special_token_fields_reach_the_sampling_params():
    sampling = completion(include_stop_str_in_output=True, skip_special_tokens=False).sampling({})
    assert sampling["include_stop_str_in_output"] is True and sampling["skip_special_tokens"] is False
    default = chat().sampling({})
    assert default["include_stop_str_in_output"] is False and default["skip_special_tokens"] is True
    with pytest.raises(ApiError) as raised:
        completion(skip_special_tokens="no")
    assert param(raised.value) == "skip_special_tokens"


def test_continue_final_message_leaves_the_answer_open():
    """vLLM's add_generation_prompt and continue_final_message reach the chat template: the
    prompt ends inside the assistant's prefill, as /tokenize renders it."""
    prompts = PromptProcessor.load(resolve_model(DEFAULT_MODEL))
    prefill = [*USER, {"role": "assistant", "content": "1, 2,"}]
    body = chat(messages=prefill, continue_final_message=True, add_generation_prompt=False)
    text = prompts.chat_text(body.conversation(), **body.template())
    assert text.endswith("<|im_start|>assistant\n1, 2,")
    opened = prompts.chat_text(chat().conversation(), **chat().template())
    assert opened.endswith("<|im_start|>assistant\n")
    closed = chat(add_generation_prompt=False)
    assert prompts.chat_text(closed.conversation(), **closed.template()).endswith(
        "Count to five.<|im_end|>\n"
    )
    both = chat(messages=prefill, continue_final_message=True)  # add_generation_prompt defaults to true
    with pytest.raises(InvalidRequestError) as raised:
        prompts.chat_text(both.conversation(), **both.template())
    assert raised.value.param == "continue_final_message"
