"""What changes a row's logits before it is sampled (and before its logprobs are read): logit
bias, stop tokens held back for min_tokens, repetition/frequency/presence penalties and the
grammar's mask. Batched over the rows that use each, in place; rows that use none are not touched
(so a plain request's tokens do not depend on what shares its batch)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replica_engine.scheduler.plan import SamplingRow
from replica_engine.structured import apply_token_bitmasks


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Apply every row's processing to `logits` ([len(rows), vocab], float32), in place."""
    for index, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), device=logits.device)
            logits[index, ids] += torch.tensor(list(bias.values()), device=logits.device)
        if row.banned_token_ids:
            logits[index, list(row.banned_token_ids)] = float("-inf")
    penalized = [i for i, row in enumerate(rows) if row.params.needs_token_history]
    if penalized:
        _apply_penalties(logits, penalized, [rows[i] for i in penalized])
    constrained = [i for i, row in enumerate(rows) if row.allowed_tokens is not None]
    if constrained:
        bitmasks = [rows[i].allowed_tokens for i in constrained]
        apply_token_bitmasks(logits, constrained, bitmasks)  # type: ignore[arg-type]


def _token_counts(token_ids: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_ids), vocab]: how often each row holds each token."""
    counts = torch.zeros(len(token_ids), vocab, device=device)
    row_index = [row for row, ids in enumerate(token_ids) for _ in ids]
    flat = [token for ids in token_ids for token in ids]
    if flat:
        counts.index_put_(
            (torch.tensor(row_index, device=device), torch.tensor(flat, device=device)),
            torch.ones(len(flat), device=device),
            accumulate=True,
        )
    return counts


def _apply_penalties(logits: torch.Tensor, index: list[int], rows: list[SamplingRow]) -> None:
    """vLLM's definitions: repetition divides a seen token's positive logit and multiplies a
    negative one (seen: in the prompt or the output); frequency subtracts per occurrence in the
    output, presence once."""
    device, vocab = logits.device, logits.shape[-1]
    selected = torch.tensor(index, device=device)
    sub = logits[selected]
    output_counts = _token_counts([row.output_token_ids for row in rows], vocab, device)
    in_output = output_counts > 0
    repetition = torch.tensor([row.params.repetition_penalty for row in rows], device=device)[:, None]
    if bool((repetition != 1).any()):
        seen = in_output | (_token_counts([row.prompt_token_ids for row in rows], vocab, device) > 0)
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)
    frequency = torch.tensor([row.params.frequency_penalty for row in rows], device=device)[:, None]
    presence = torch.tensor([row.params.presence_penalty for row in rows], device=device)[:, None]
    sub = sub - frequency * output_counts - presence * in_output
    logits[selected] = sub
