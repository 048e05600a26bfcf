"""The GPU-only paths of the model runner, rehearsed on the CPU so they cannot rot before a GPU is
lent: sizing the KV pool from gpu_memory_utilization runs a full-budget profile step through the
runner's current batch API. CUDA's memory counters cannot run here: a stand-in gives fixed figures
(weights and the rest of the process: 1 GiB used of 10 GiB; the profile step: 256 MiB at its peak)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

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


def test_the_kv_pool_is_sized_from_gpu_memory_utilization_after_a_profile_step(monkeypatch):
    source = resolve_model("dummy:tiny-llama")
    model_config = load_config(source)
    config = EngineConfig(model="dummy:tiny-llama", dtype="float32", max_num_batched_tokens=128).resolve(
        model_config
    )
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
    assert runner.rows.num_held == 0  # the profile's row is forgotten
    assert runner.kv_caches == []  # and its throwaway pool dropped, for the real one
