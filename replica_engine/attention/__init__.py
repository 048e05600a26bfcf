"""Attention backends behind one interface; `get_backend` picks one by name."""

from __future__ import annotations

from replica_engine.attention.base import INVALID_BLOCK_ID, AttentionBackend, AttentionMetadata
from replica_engine.attention.torch_ref import TorchAttention
from replica_engine.errors import InvalidRequestError

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}


def get_backend(name: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise InvalidRequestError(
            "attention_backend", f"unknown backend {name!r}; have {sorted(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name]()


__all__ = ["ATTENTION_BACKENDS", "INVALID_BLOCK_ID", "AttentionBackend", "AttentionMetadata", "get_backend"]
