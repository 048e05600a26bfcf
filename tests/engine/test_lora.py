"""Multi-LoRA in the engine, against transformers + PEFT on real PEFT adapters (random weights,
built by `peft` on SmolLM2's shape: nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import InvalidRequestError
from common.lora import read_adapter
from common.structured_outputs import StructuredOutputs
from harness.hf_reference import assert_matches_up_to_ties, hf_greedy_batch
from harness.lora_adapters import save_random_adapter
from replica_engine import LLM, LoRARequest, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory) -> dict[str, LoRARequest]:
    """`a`: every target module, rank 8; `b`: three modules, rank 4; `c`: attention only, rank 2."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "a": dict(seed=1, rank=8, std=0.05),
        "b": dict(seed=2, rank=4, target_modules=("q_proj", "v_proj", "down_proj"), std=0.08),
        "c": dict(seed=3, rank=2, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), std=0.1),
    }
    return {
        name: LoRARequest(name, str(save_random_adapter(hf_model, root / name, **spec)))
        for name, spec in specs.items()
    }


@pytest.fixture(scope="module")
def lora_llm() -> LLM:
    """fp32 on dequantized weights (the exactness setting), two adapter slots, a host LRU of two."""
    return LLM(dtype="float32", quantization="none", enable_lora=True, max_loras=2, max_cpu_loras=2)


def _peft_greedy(hf_model, lora: LoRARequest | None, prompt_ids: list[list[int]]) -> list[list[int]]:
    from peft import PeftModel

    if lora is None:
        return hf_greedy_batch(hf_model, prompt_ids, MAX_TOKENS)
    model = PeftModel.from_pretrained(hf_model, lora.path)
    try:
        return hf_greedy_batch(model, prompt_ids, MAX_TOKENS)
    finally:
        model.unload()  # hf_model's own layers back


def _record_step_adapters(llm: LLM) -> list[set[str | None]]:
    """The adapters (None: base) of every step's rows, as the runner is handed them."""
    steps: list[set[str | None]] = []
    manager = llm.engine.core.runner.lora
    prepare = manager.prepare

    def recording(rows):
        rows = list(rows)
        steps.append({lora.name if lora else None for lora, _ in rows})
        prepare(rows)

    manager.prepare = recording
    return steps


def test_mixed_batch_matches_transformers_peft(lora_llm, adapters, hf_model, tokenizer):
    """One batch mixing the base model and two adapters: each request's greedy output is
    transformers + PEFT's for its own adapter, and the adapters change the output."""
    steps = _record_step_adapters(lora_llm)
    loras = [None, adapters["a"], adapters["b"]]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, lora=lora) for lora in loras]
    outs = lora_llm.generate(PROMPTS * 3, [p for p in params for _ in PROMPTS])
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    by_adapter = {}
    for index, lora in enumerate(loras):
        theirs = _peft_greedy(hf_model, lora, prompt_ids)
        ours = [out.outputs[0].token_ids for out in outs[index * 3 : index * 3 + 3]]
        by_adapter[lora.name if lora else None] = ours
        for ids, mine, their in zip(prompt_ids, ours, theirs, strict=True):
            assert_matches_up_to_ties(hf_model, ids, mine, their, f"adapter {lora and lora.name}")
    assert by_adapter["a"] != by_adapter[None] and by_adapter["b"] != by_adapter[None]
    assert any(len(step) == 3 for step in steps), "no step mixed both adapters with the base model"
    kv = lora_llm.engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_on_demand_load_lru_and_slots(lora_llm, adapters):
    """Adapters load on first use; a third evicts the least recently used from the host LRU
    (max_cpu_loras 2) and is reloaded from disk when asked again. With two slots, no step runs
    three adapters: the third waits, and its output is what it gives alone."""
    manager = lora_llm.engine.core.runner.lora
    steps = _record_step_adapters(lora_llm)
    alone = lora_llm.generate(PROMPTS[0], GREEDY, lora_request=adapters["c"])[0].outputs[0].token_ids
    assert [lora.name for lora in manager.loaded][-1] == "c"
    assert "a" not in {lora.name for lora in manager.loaded} or "b" not in {
        lora.name for lora in manager.loaded
    }
    mixed = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, lora=adapters[n]) for n in "abc"]
    outs = lora_llm.generate([PROMPTS[0]] * 3, mixed)
    assert outs[2].outputs[0].token_ids == alone
    assert max(len(step - {None}) for step in steps) <= 2
    assert len(manager.loaded) == 2 and set(manager.load_times_s) == {"a", "b", "c"}
    assert lora_llm.engine.core.stats.lora_adapters[-1] in {"a", "b", "c"}


def test_prefix_cache_is_not_shared_across_adapters(lora_llm, adapters):
    prompt = "Tell me about the history of the printing press in Europe, " * 4
    lora_llm.generate(prompt, GREEDY)
    first_a = lora_llm.generate(prompt, GREEDY, lora_request=adapters["a"])[0]
    again_a = lora_llm.generate(prompt, GREEDY, lora_request=adapters["a"])[0]
    other = lora_llm.generate(prompt, GREEDY, lora_request=adapters["b"])[0]
    assert first_a.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again_a.num_cached_tokens > 0 and again_a.outputs[0].token_ids == first_a.outputs[0].token_ids


def test_adapter_requests_under_preemption_logprobs_and_grammar(lora_llm, adapters):
    """A pool too small for the batch preempts adapter requests; they recompute with their own
    adapter and give what a roomy pool gives. Logprobs and structured outputs apply to them."""
    roomy = lora_llm
    tight = LLM(
        dtype="float32", quantization="none", enable_lora=True, max_loras=2, num_kv_blocks=8, block_size=4
    )
    loras = [adapters["a"], adapters["b"], None] * 2
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, lora=lora, logprobs=2) for lora in loras]
    expected = roomy.generate(PROMPTS * 2, params)
    got = tight.generate(PROMPTS * 2, params)
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for out in (o.outputs[0] for o in got):
        assert len(out.logprobs) == MAX_TOKENS
        assert all(entry.token_id == token for entry, token in zip(out.logprobs, out.token_ids, strict=True))
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    structured = SamplingParams(
        max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs(json=json.dumps(schema))
    )
    answer = roomy.generate("Name a city as JSON:", structured, lora_request=adapters["a"])[0]
    assert isinstance(json.loads(answer.outputs[0].text)["city"], str)


def test_abort_frees_an_adapter_request(lora_llm, adapters):
    engine = lora_llm.engine
    request_id = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=200, lora=adapters["a"]))
    engine.step()
    engine.step()
    engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.core.kv_cache_manager.num_free_blocks == engine.core.kv_cache_manager.num_blocks


def _copy_adapter(source: LoRARequest, path: Path) -> Path:
    path.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (path / name).write_bytes((Path(source.path) / name).read_bytes())
    return path


def test_bad_adapters_are_refused_naming_model(lora_llm, exact_llm, adapters, tmp_path, hf_model):
    """Refused when the request is added (before any step), with the reason."""
    a = adapters["a"]

    def refused(lora: LoRARequest, needle: str, llm: LLM = lora_llm) -> None:
        with pytest.raises(InvalidRequestError, match=needle) as caught:
            llm.generate(PROMPTS[0], GREEDY, lora_request=lora)
        assert caught.value.param == "model"

    refused(LoRARequest("missing", str(tmp_path / "missing")), "no adapter_config.json")
    refused(a, "enable_lora off", exact_llm)
    with pytest.raises(InvalidRequestError, match="rank 8 is above this replica's max_lora_rank 4"):
        read_adapter(a, hf_model.config, max_lora_rank=4)  # what the engine calls when a request is added

    unknown = _copy_adapter(a, tmp_path / "unknown")
    config = json.loads((unknown / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "lm_head"]
    (unknown / "adapter_config.json").write_text(json.dumps(config))
    refused(LoRARequest("unknown", str(unknown)), "lm_head")

    wrong = _copy_adapter(a, tmp_path / "wrong")
    tensors = load_file(wrong / "adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, wrong / "adapter_model.safetensors")
    refused(LoRARequest("wrong", str(wrong)), "expected")
    assert not lora_llm.engine.has_unfinished_requests()


@pytest.mark.usefixtures("unpriced_drafts")
def test_speculation_keeps_each_adapters_greedy_tokens(lora_llm, adapters):
    """Drafts verified through the request's own adapter: base and adapter requests in one batch,
    with suffix decoding, answer the tokens they answer without it."""
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2,", *PROMPTS]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, lora=lora)
        for lora in (None, adapters["a"], adapters["b"])
        for _ in prompts
    ]
    plain = [o.outputs[0].token_ids for o in lora_llm.generate(prompts * 3, params)]
    speculating = LLM(
        dtype="float32",
        quantization="none",
        enable_lora=True,
        max_loras=2,
        speculative_config={"method": "suffix"},
    )
    assert [o.outputs[0].token_ids for o in speculating.generate(prompts * 3, params)] == plain
    assert speculating.engine.core.scheduler.num_accepted_tokens > 0, "nothing was drafted: not a test"
