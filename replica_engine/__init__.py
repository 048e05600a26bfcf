"""stallfree's replica engine: usable on its own, without Ray."""

from replica_engine.async_engine import AsyncEngine
from replica_engine.config import EngineConfig
from replica_engine.engine import EngineStats, LLMEngine
from replica_engine.errors import EngineDeadError, InvalidRequestError
from replica_engine.llm import LLM
from replica_engine.models.sources import DEFAULT_MODEL
from replica_engine.outputs import CompletionOutput, RequestOutput
from replica_engine.sampling_params import SamplingParams

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
    "RequestOutput",
    "SamplingParams",
]
