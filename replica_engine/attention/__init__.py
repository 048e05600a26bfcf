"""Attention backends behind one interface; `get_backend` picks one by name."""

from __future__ import annotations

from common.errors import InvalidRequestError
from replica_engine.attention.base import AttentionBackend, AttentionMetadata, NullBlockWriteError
from replica_engine.attention.torch_ref import TorchAttention

ATTENTION_BACKENDS = ("torch", "cpu", "triton")


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "cpu":
        from replica_engine.attention.cpu_paged import CPUPagedAttention

        try:
            return CPUPagedAttention()
        except RuntimeError as error:
            raise InvalidRequestError("attention_backend", str(error)) from None
    if name == "triton":
        try:  # imported only when asked for: triton is optional off the GPU
            from replica_engine.attention.triton_paged import TritonAttention
        except ImportError as error:
            raise InvalidRequestError("attention_backend", f"triton is not available: {error}") from None
        return TritonAttention()
    raise InvalidRequestError("attention_backend", f"unknown {name!r}; have {list(ATTENTION_BACKENDS)}")


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "NullBlockWriteError",
    "get_backend",
]
