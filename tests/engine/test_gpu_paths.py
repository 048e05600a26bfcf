"""The GPU-only paths of the model runner, rehearsed on the CPU so they cannot rot before a GPU is
lent. Sizing the KV pool from gpu_memory_utilization runs a full-budget profile step through the
runner's current batch API; CUDA's memory counters cannot run here: a stand-in gives fixed figures
(weights and the rest of the process: 1 GiB used of 10 GiB; the profile step: 256 MiB at its peak).
Decode steps with cuda_graphs go through the padded static inputs a captured graph replays (the
capture itself needs a GPU: bench.gpu's first run checks it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import InvalidRequestError
from common.model_source import resolve_model
from replica_engine import EngineConfig
from replica_engine.attention import get_backend
from replica_engine.kv_cache_manager import blocks_in_bytes
from replica_engine.model_runner import ModelRunner
from replica_engine.models.loader import load_config, load_model

GiB, MiB = 1 << 30, 1 << 20


class FakeCudaMemory:
    """torch.cuda's memory counters for a 10 GiB device with 1 GiB in use; a step adds 256 MiB at
    its peak. Records what the runner asked for."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, name=name, **k: self.calls.append(name))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: GiB)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: GiB + 256 * MiB)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (9 * GiB, 10 * GiB))


@pytest.mark.parametrize("max_model_len", [None, 48])  # 48: the budget spans three rows
def test_the_kv_pool_is_sized_from_gpu_memory_utilization_after_a_profile_step(monkeypatch, max_model_len):
    source = resolve_model("dummy:tiny-llama")
    model_config = load_config(source)
    config = EngineConfig(
        model="dummy:tiny-llama", dtype="float32", max_num_batched_tokens=128, max_model_len=max_model_len
    ).resolve(model_config)
    config = dataclasses.replace(config, kv_cache_bytes=None, num_kv_blocks=None, gpu_memory_utilization=0.5)
    model = load_model(
        source, model_config, get_backend("torch"), torch.float32, torch.device("cpu"), config.max_model_len
    )
    runner = ModelRunner(model, config)
    fake = FakeCudaMemory()
    fake.install(monkeypatch)

    num_blocks = runner.num_kv_blocks()

    # 10 GiB x 0.5, less the 1 GiB in use, less the profile step's 256 MiB peak.
    assert num_blocks == blocks_in_bytes(5 * GiB - GiB - 256 * MiB, runner.bytes_per_block)
    assert fake.calls.count("reset_peak_memory_stats") == 1 and "empty_cache" in fake.calls
    assert runner.rows.num_held == 0  # the profile's rows are forgotten
    assert runner.kv_caches == []  # and its throwaway pool dropped, for the real one


def test_decode_steps_through_the_padded_static_batch_give_the_same_tokens(tmp_path, monkeypatch):
    """cuda_graphs on the CPU: no graph is captured, but every decode step goes through the
    padded static inputs a graph would replay (requests finishing at different steps: 3 rows,
    then 2, then 1). Transformers' random init keeps the logits apart, so any mixing of rows
    or a stale input would change a token."""
    from bench.gpu.gpu_checks import random_checkpoint, random_prompts
    from replica_engine import LLM, SamplingParams
    from replica_engine.decode_graphs import DecodeGraphs

    checkpoint = random_checkpoint(tmp_path, "tiny-llama")
    prompts = random_prompts((7, 19, 30), vocab_size=512)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 6, 9)]
    settings = dict(
        model=str(checkpoint), dtype="float32", attention_backend="triton", kv_cache_bytes=4 << 20
    )
    expected = [o.outputs[0].token_ids for o in LLM(**settings).generate(prompts, params)]

    padded: list[tuple[int, int]] = []
    run = DecodeGraphs.run

    def spy(self: DecodeGraphs, flat):
        num_rows = flat.input_ids.shape[0]
        padded.append((num_rows, self.padded_size(num_rows)))
        return run(self, flat)

    monkeypatch.setattr(DecodeGraphs, "run", spy)
    llm = LLM(**settings, cuda_graphs=True, max_num_seqs=6)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert {(3, 4), (2, 2), (1, 1)} <= set(padded), padded
    assert llm.engine.core.runner.decode_graphs.sizes == (1, 2, 4, 6)
    assert not llm.engine.core.runner.decode_graphs.graphs  # nothing captured on a CPU


def test_the_fused_rotary_and_kv_write_answer_as_the_rotation_and_the_backends_write(tmp_path, monkeypatch):
    """On a GPU one Triton launch a layer rotates q and k and writes the step's K and V into their
    cache slots (pointwise.rotary_store_). Here it is made to apply on the CPU (the kernel
    interpreted), in steps that mix prompt chunks and decodes: the model must answer as with the
    CPU kernel's rotation and store, the same greedy tokens with the same logprobs."""
    from bench.gpu.gpu_checks import random_checkpoint, random_prompts
    from replica_engine import LLM, SamplingParams
    from replica_engine.kernels import pointwise, triton_pointwise

    checkpoint = random_checkpoint(tmp_path, "tiny-llama")
    prompts = random_prompts((7, 19, 30), vocab_size=512)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0) for n in (3, 6, 9)]
    settings = dict(
        model=str(checkpoint), dtype="float32", attention_backend="triton", kv_cache_bytes=4 << 20,
        max_num_batched_tokens=24,  # the 30-token prompt in two chunks, beside the others' decodes
    )  # fmt: skip

    def answers(llm: LLM) -> list[tuple[list[int], list[float]]]:
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outputs]

    expected = answers(LLM(**settings))
    fused_rows: list[int] = []

    def on_the_cpu(q, k, v, cos_sin, kv_cache, slot_mapping) -> bool:
        triton_pointwise.rotary_store_(q, k, v, *cos_sin, *kv_cache, slot_mapping)
        fused_rows.append(q.shape[0])
        return True

    monkeypatch.setattr(pointwise, "rotary_store_", on_the_cpu)
    answered = answers(LLM(**settings))
    assert fused_rows and max(fused_rows) > 1  # the fused path ran, prompt chunks included
    assert [tokens for tokens, _ in answered] == [tokens for tokens, _ in expected]
    for (_, logprobs), (_, expected_logprobs) in zip(answered, expected, strict=True):
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)


def test_cuda_graphs_need_the_triton_backend():
    from replica_engine import LLM

    with pytest.raises(InvalidRequestError, match="cuda_graphs"):
        LLM(model="dummy:tiny-llama", attention_backend="torch", cuda_graphs=True, kv_cache_bytes=4 << 20)


@pytest.mark.parametrize(
    ("device", "backend", "expected"),
    [("cpu", "auto", False), ("cuda", "auto", True), ("cuda", "torch", False)],
)
def test_cuda_graphs_default_on_for_a_gpu_with_triton(monkeypatch, device, backend, expected):
    """Resolved only (no model runs): a GPU is pretended, which is all the resolution asks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model_config = load_config(resolve_model("dummy:tiny-llama"))
    config = EngineConfig(model="dummy:tiny-llama", device=device, attention_backend=backend)
    assert config.resolve(model_config).cuda_graphs is expected


@pytest.mark.parametrize(
    ("device", "settings", "expected"),
    [
        ("cpu", {}, False),
        ("cuda", {}, True),
        ("auto", {}, True),  # a GPU is found
        ("cuda", {"core_process": False}, False),
        ("cpu", {"core_process": True}, True),
        ("cuda", {"tensor_parallel_size": 2}, False),  # parallel workers: a thread, as before
    ],
)
def test_the_engine_core_runs_in_its_own_process_by_default_on_a_gpu(monkeypatch, device, settings, expected):
    """Resolved only (no model runs): a GPU is pretended. On a GPU the core's host work (scheduling,
    inputs, launches) and the replica's streaming would share one interpreter; on a CPU the
    model's threads take the cores whichever process they are in."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = EngineConfig(model="dummy:tiny-llama", device=device, **settings)
    assert config.runs_core_in_process is expected
    if settings.get("tensor_parallel_size", 1) == 1:
        assert config.resolve(load_config(resolve_model("dummy:tiny-llama"))).core_process is expected


def test_core_process_takes_true_false_or_unset():
    with pytest.raises(InvalidRequestError, match="core_process"):
        EngineConfig(model="dummy:tiny-llama", core_process="yes")
