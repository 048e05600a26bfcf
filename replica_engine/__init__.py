"""stallfree's replica engine: usable on its own, without Ray.

The names below load on first use (PEP 562), so that the torch-free parts (the scheduler, the KV
cache manager, requests) import without torch: the fleet simulator runs them on a virtual clock."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.errors import InvalidRequestError
    from common.model_source import DEFAULT_MODEL
    from common.sampling_params import SamplingParams
    from replica_engine.async_engine import AsyncEngine
    from replica_engine.config import EngineConfig
    from replica_engine.engine import EngineStats, LLMEngine
    from replica_engine.errors import EngineDeadError
    from replica_engine.llm import LLM
    from replica_engine.outputs import CompletionOutput, RequestDelta, RequestOutput

_HOMES = {
    "DEFAULT_MODEL": "common.model_source",
    "LLM": "replica_engine.llm",
    "AsyncEngine": "replica_engine.async_engine",
    "CompletionOutput": "replica_engine.outputs",
    "RequestOutput": "replica_engine.outputs",
    "EngineConfig": "replica_engine.config",
    "EngineDeadError": "replica_engine.errors",
    "EngineStats": "replica_engine.engine",
    "InvalidRequestError": "common.errors",
    "LLMEngine": "replica_engine.engine",
    "LoRARequest": "common.lora",
    "RequestDelta": "replica_engine.outputs",
    "SamplingParams": "common.sampling_params",
}
__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "InvalidRequestError",
    "LLMEngine",
    "LoRARequest",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'replica_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
