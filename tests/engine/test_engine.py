"""The engine with the real SmolLM2: validation, abort, stops, seeds, chat."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replica_engine import LLM, EngineConfig, InvalidRequestError, SamplingParams


def _all_blocks_free(llm: LLM) -> bool:
    stats = llm.engine.stats()
    return stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0),
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # ended with <|im_end|>, which is not in the text
    assert "<|im_end|>" not in out[0].outputs[0].text
    assert out[0].outputs[0].token_ids[-1] == llm.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_generate_returns_text_tokens_and_length_finish(llm):
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=5, temperature=0))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert out.outputs[0].text.startswith(" Paris")


def test_token_id_prompts_equal_text_prompts(llm):
    params = SamplingParams(max_tokens=6, temperature=0)
    by_text = llm.generate("def add(a, b):", params)[0]
    by_ids = llm.generate([llm.tokenizer.encode("def add(a, b):")], params)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_stop_string_ends_the_request_and_is_cut_from_the_text(llm):
    params = SamplingParams(max_tokens=40, temperature=0)
    full = llm.generate("1, 2, 3, 4,", params)[0].outputs[0].text
    assert " 7," in full
    out = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=40, temperature=0, stop=[" 7,"]))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == full[: full.index(" 7,")]
    assert _all_blocks_free(llm)


def test_extra_stop_token_ids_and_ignore_eos(llm):
    params = SamplingParams(max_tokens=20, temperature=0)
    first = llm.generate("The capital of France is", params)[0].outputs[0].token_ids[2]
    out = llm.generate(
        "The capital of France is", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[first])
    )[0]
    assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) == 3
    chat = [{"role": "user", "content": "Say hi."}]
    out = llm.chat(chat, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 30


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    alone = llm.generate("Tell me a story:", params)[0].outputs[0].token_ids
    batch = llm.generate(
        ["Tell me a story:", "Other", "Another prompt here"],
        [params, SamplingParams(max_tokens=12), SamplingParams(max_tokens=3, temperature=0.5)],
    )
    assert batch[0].outputs[0].token_ids == alone
    reseeded = SamplingParams(max_tokens=12, temperature=1.0, seed=99)
    other = llm.generate("Tell me a story:", reseeded)[0].outputs[0].token_ids
    assert other != alone


def test_abort_mid_generation_frees_every_block(llm):
    engine = llm.engine
    long_id = engine.add_request(
        "Count to one hundred: 1, 2, 3,", SamplingParams(max_tokens=200, temperature=0)
    )
    other_id = engine.add_request("Hello", SamplingParams(max_tokens=8, temperature=0))
    for _ in range(4):
        engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_total_blocks
    final = engine.abort_request(long_id)
    assert final.finished and final.finish_reason == "abort"
    assert engine.abort_request(long_id) is None  # not in flight any more
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {other_id}  # the aborted request never comes back
    assert _all_blocks_free(llm)


@pytest.mark.parametrize(
    "prompt,params,param",
    [
        ("", {}, "prompt"),
        ([[]], {}, "prompt"),  # one prompt of zero token ids
        ([1, 2, 10**9], {}, "prompt"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"max_tokens": -1}, "max_tokens"),
        ("hi", {"temperature": -0.5}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.5}, "top_p"),
        ("hi", {"top_k": -2}, "top_k"),
        ("hi", {"stop": [""]}, "stop"),
        ("hi", {"seed": 2**63}, "seed"),  # past int64: torch's generator would overflow
        ("hi", {"seed": -(2**63) - 1}, "seed"),
        ("hi", {"max_tokens": 9000}, "prompt"),  # prompt + max_tokens > max_model_len (8192)
    ],
)
def test_bad_requests_raise_value_errors_naming_the_field(llm, prompt, params, param):
    with pytest.raises(ValueError) as error:
        llm.generate(prompt, SamplingParams(**params))
    assert isinstance(error.value, InvalidRequestError) and error.value.param == param
    assert _all_blocks_free(llm)


def test_context_length_error_says_so(llm):
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("word " * 8000, SamplingParams(max_tokens=500))
    assert error.value.code == "context_length_exceeded" and "8192" in str(error.value)


def test_a_request_larger_than_the_whole_kv_pool_is_rejected_up_front():
    llm = LLM(num_kv_blocks=4)  # 64 tokens
    with pytest.raises(InvalidRequestError, match="whole KV pool"):
        llm.generate("hello " * 40, SamplingParams(max_tokens=30))
    assert llm.generate("hello", SamplingParams(max_tokens=3))[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "settings,param",
    [
        ({"model": "/no/such/model"}, "model"),
        ({"model": "dummy:gpt-17"}, "model"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"scheduling_policy": "lottery"}, "scheduling_policy"),
        ({"attention_backend": "magic"}, "attention_backend"),
        ({"dtype": "int3"}, "dtype"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_model_len": 10**6}, "max_model_len"),
        ({"device": "cuda"}, "device"),  # no GPU on CI: says so instead of crashing later
    ],
)
def test_bad_engine_settings_raise_value_errors_naming_the_field(settings, param):
    with pytest.raises(InvalidRequestError) as error:
        LLM(**settings)
    assert error.value.param == param


def test_dummy_weights_run_on_token_ids_and_refuse_text():
    llm = LLM("dummy:smollm2-135m", max_model_len=256)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.generate("text", SamplingParams())


def test_engine_config_is_resolved_for_cpu(llm):
    config: EngineConfig = llm.engine.config
    # Our CPU kernels where they build (AVX-512, as on this project's machines), else the reference.
    kernels = "cpu" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "torch"
    assert (config.device, config.dtype, config.attention_backend) == ("cpu", "float32", kernels)
    assert config.max_model_len == 8192 and config.max_num_batched_tokens == 2048  # offline default
    serving = EngineConfig().resolve(llm.engine.model_config)
    assert serving.max_num_batched_tokens == 256
    # dtype auto: bf16 where the CPU has native bf16 dot products or AMX (as /proc/cpuinfo says).
    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert serving.dtype == ("bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32")
