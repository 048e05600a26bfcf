"""On a CPU a plain decoder layer runs as one kernel call (models/fused_layer.py) where its
module made a dozen, and a model whose every layer is plain runs them all in one call a step:
the same kernels in the same order on the same rows, so every token's numbers must be the
modules', bit for bit, in decode-only steps and in steps that mix prompt
chunks with decodes, over 4-bit weights (the embedded SmolLM2's own) and packed float ones. With
LoRA on, a step of base-model rows alone runs them too; one holding an adapter's rows runs the
modules."""

from __future__ import annotations

import dataclasses

import pytest

from harness.lora_adapters import save_random_adapter
from replica_engine import LLM, LoRARequest, SamplingParams
from replica_engine.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.cpu_ops() is None, reason="the CPU kernels need AVX-512 and a C++ compiler"
)

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea, then explain each of its lines in one short sentence.",
    "1, 2, 3, 4,",
]


class Counting:
    """The kernels' `decoder_layer` or a DecoderStack's `forward`, counting calls by whether their
    step held prompt rows."""

    def __init__(self, target, method: str) -> None:
        self.steps_by_kind = {"decodes only": 0, "with prompt rows": 0}
        call = getattr(target, method)

        def counted(*args):
            max_query_len = args[-2][3]  # the step's AttentionMetadata.kernel_args
            self.steps_by_kind["decodes only" if max_query_len == 1 else "with prompt rows"] += 1
            return call(*args)

        setattr(self, method, counted)


def answers(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outputs]


SETTINGS = pytest.mark.parametrize(
    "settings",
    [{}, {"dtype": "float32", "quantization": "none"}],
    ids=["4-bit weights", "packed float32 weights"],
)


def fused_llm(settings: dict) -> LLM:
    # A 16-token budget: prompts in chunks beside the others' decodes, then decode-only steps.
    return LLM(max_num_batched_tokens=16, enable_prefix_caching=False, kv_cache_bytes=8 << 20, **settings)


@SETTINGS
def test_a_fused_layer_answers_as_its_module(settings):
    llm = fused_llm(settings)
    model = llm.engine.core.runner.model
    layers = model.model.layers
    assert all(layer.fused is not None for layer in layers)
    model.fused_stack = None  # layer by layer
    counting = Counting(layers[0].fused.ops, "decoder_layer")
    for layer in layers:
        layer.fused = dataclasses.replace(layer.fused, ops=counting)
    fused = answers(llm)
    assert all(counting.steps_by_kind.values()), counting.steps_by_kind
    for layer in layers:
        layer.fused = None
    assert fused == answers(llm)


@SETTINGS
def test_the_stacked_layers_answer_as_their_modules(settings):
    llm = fused_llm(settings)
    model = llm.engine.core.runner.model
    assert model.fused_stack is not None
    counting = Counting(model.fused_stack.stack, "forward")
    model.fused_stack = dataclasses.replace(model.fused_stack, stack=counting)
    stacked = answers(llm)
    assert all(counting.steps_by_kind.values()), counting.steps_by_kind
    model.fused_stack = None
    for layer in model.model.layers:
        layer.fused = None
    assert stacked == answers(llm)


def test_with_lora_on_only_steps_holding_an_adapters_rows_leave_the_stack(hf_model, tmp_path):
    llm = fused_llm({"enable_lora": True, "max_loras": 1})
    model = llm.engine.core.runner.model
    counting = Counting(model.fused_stack.stack, "forward")
    model.fused_stack = dataclasses.replace(model.fused_stack, stack=counting)
    base = answers(llm)
    stacked = sum(counting.steps_by_kind.values())
    assert stacked > 0  # LoRA on, no adapter asked for: the stack, not the modules

    adapter = LoRARequest("a", str(save_random_adapter(hf_model, tmp_path / "a", seed=1, std=0.05)))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, lora=adapter)
    with_adapter = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert sum(counting.steps_by_kind.values()) == stacked  # every step held an adapter's rows
    assert base == answers(llm) and sum(counting.steps_by_kind.values()) > stacked  # the stack again

    model.fused_stack = None
    for layer in model.model.layers:
        layer.fused = None
    assert base == answers(llm)  # the modules', bit for bit
    assert with_adapter == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
