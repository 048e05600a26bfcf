"""Embeddings: a prompt-only request's vector, pooled from the model's final hidden states (after
its last RMSNorm, in float32). The model runner computes each prompt chunk's part (its tokens' sum
for `mean`; its last token's state for `last`); the engine core adds the parts up across chunks
and finishes the vector once the whole prompt has run. Torch-free at import (the core's side runs
in the fleet simulator): it only calls the methods of the tensors it is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class Pooling:
    """How an embedding request's vector is made (the engine's `pooling` and
    `normalize_embeddings` settings)."""

    type: str  # one of POOLING_TYPES
    normalize: bool  # to unit L2 length, as OpenAI's embeddings are

    @property
    def needs_every_token(self) -> bool:
        """Mean pooling sums every prompt token's hidden state, so none may be skipped by a
        prefix-cache hit (a hit gives K/V, not hidden states)."""
        return self.type == "mean"

    def chunk_part(self, hidden: torch.Tensor) -> torch.Tensor:
        """One prompt chunk's part, from its tokens' hidden states [tokens, hidden]."""
        if self.type == "mean":
            return hidden.float().sum(0)
        return hidden[-1].float()

    def add(self, so_far: torch.Tensor | None, part: torch.Tensor, start_position: int) -> torch.Tensor:
        """The parts so far with a chunk's part added. A chunk at position 0 starts afresh (a
        preempted request recomputes its prompt); for `last` each chunk's part replaces the one
        before, so the final chunk's last token is what remains."""
        if self.type == "last" or so_far is None or start_position == 0:
            return part
        return so_far + part

    def finish(self, total: torch.Tensor, num_prompt_tokens: int) -> list[float]:
        """The embedding, once every prompt token's part is in."""
        vector = total / num_prompt_tokens if self.type == "mean" else total
        if self.normalize:
            vector = vector / vector.norm().clamp_min(1e-12)  # as torch.nn.functional.normalize
        return vector.tolist()
