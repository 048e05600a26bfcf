"""stallfree's replica engine: usable on its own, without Ray."""

from common.errors import InvalidRequestError
from common.model_source import DEFAULT_MODEL
from common.sampling_params import SamplingParams
from replica_engine.async_engine import AsyncEngine
from replica_engine.config import EngineConfig
from replica_engine.engine import EngineStats, LLMEngine
from replica_engine.errors import EngineDeadError
from replica_engine.llm import LLM
from replica_engine.outputs import CompletionOutput, RequestOutput

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
