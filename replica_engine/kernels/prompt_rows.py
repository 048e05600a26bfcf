"""Which rows of a step's activations are prompt tokens, for the linear layers over quantized
weights: there, on a CPU with bfloat16 dot products, prompt rows meet the weight dequantized to
bfloat16 (quantized_linear's dense rows, at the bf16 matmul rate once a step has many), and the
tokens the model generates keep the int16 path that decode steps run fastest.

The path is a property of the token, never of what shares its step: a prompt token's numbers are
the same in a chunk of 1 or of 256, beside decodes or not, from the prefix cache or recomputed,
and so are a generated token's (recomputed after preemption, a generated token is still one).
The model runner sets the rows around the decoder's forward (not the LM head: logits always come
from the int16 path)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptRows:
    num_rows: int  # the step's tokens: activations of another row count are not the step's
    first: int | None  # the prompt rows are the rows from `first` on (the usual step: decodes first)
    mask: torch.Tensor | None  # else: which rows are (bool [num_rows]), where kinds interleave

    @classmethod
    def of(cls, counts: Iterable[tuple[int, int]]) -> PromptRows | None:
        """From each row's (tokens, how many of its leading tokens are its prompt's), in batch
        order; None when the step holds no prompt token. Row by row, not token by token: a
        mask is built only where generated tokens follow prompt ones (a recomputed request)."""
        counts = list(counts)
        num_rows = first = 0
        prompt_seen = interleaved = False
        for num_tokens, num_prompt in counts:
            if num_prompt and not prompt_seen:
                first, prompt_seen = num_rows, True
            interleaved |= prompt_seen and num_prompt < num_tokens
            num_rows += num_tokens
        if not prompt_seen:
            return None
        if not interleaved:
            return cls(num_rows, first, None)
        kinds = [kind for n, p in counts for kind in [True] * p + [False] * (n - p)]
        return cls(num_rows, None, torch.tensor(kinds))


_CURRENT: ContextVar[PromptRows | None] = ContextVar("prompt_rows", default=None)


@contextlib.contextmanager
def prompt_rows(rows: PromptRows | None) -> Iterator[None]:
    """The step's prompt rows, for the linear layers run within."""
    token = _CURRENT.set(rows)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current(num_rows: int) -> PromptRows | None:
    """The prompt rows of the step being run, if `num_rows` activations are its rows."""
    rows = _CURRENT.get()
    return rows if rows is not None and rows.num_rows == num_rows else None
