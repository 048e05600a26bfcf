"""What changes a row's logits before it is sampled (and before its logprobs are read): logit
bias, stop tokens held back for min_tokens, repetition/frequency/presence penalties and the
grammar's mask. Batched over the rows that use each, in place; rows that use none are not touched
(so a plain request's tokens do not depend on what shares its batch)."""

from __future__ import annotations

import torch

from replica_engine.device_transfer import to_device
from replica_engine.scheduler.plan import SamplingRow
from replica_engine.structured import apply_token_bitmasks


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Apply every row's processing to `logits` ([len(rows), vocab], float32), in place (the
    rows' values go over without waiting for the device: device_transfer.py)."""
    device = logits.device
    for index, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            ids = to_device(list(bias), torch.int64, device)
            logits[index, ids] += to_device(list(bias.values()), torch.float32, device)
        if row.banned_token_ids:
            logits[index, to_device(list(row.banned_token_ids), torch.int64, device)] = float("-inf")
    penalized = [i for i, row in enumerate(rows) if row.params.needs_token_history]
    if penalized:
        _apply_penalties(logits, penalized, [rows[i] for i in penalized])
    constrained = [i for i, row in enumerate(rows) if row.allowed_tokens is not None]
    if constrained:
        bitmasks = [rows[i].allowed_tokens for i in constrained]
        apply_token_bitmasks(logits, constrained, bitmasks)  # type: ignore[arg-type]


def _apply_penalties(logits: torch.Tensor, index: list[int], rows: list[SamplingRow]) -> None:
    """vLLM's definitions: repetition divides a seen token's positive logit and multiplies a
    negative one (seen: in the prompt or the output); frequency subtracts per occurrence in the
    output, presence once. Each row's counts are the runner's, kept across steps
    (persistent_batch.py): nothing is recounted per step."""
    device, vocab = logits.device, logits.shape[-1]
    selected = to_device(index, torch.int64, device)
    sub = logits[selected]
    output_counts = torch.stack([_vocab_row(row.output_counts, vocab, torch.float32, device) for row in rows])
    in_output = output_counts > 0
    if any(row.params.repetition_penalty != 1 for row in rows):
        repetition = to_device([row.params.repetition_penalty for row in rows], torch.float32, device)[
            :, None
        ]
        prompt_seen = torch.stack([_vocab_row(row.prompt_seen, vocab, torch.bool, device) for row in rows])
        seen = in_output | prompt_seen
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)
    frequency = to_device([row.params.frequency_penalty for row in rows], torch.float32, device)[:, None]
    presence = to_device([row.params.presence_penalty for row in rows], torch.float32, device)[:, None]
    sub = sub - frequency * output_counts - presence * in_output
    logits[selected] = sub


def _vocab_row(
    values: torch.Tensor | None, vocab: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A row's [vocab] counts or flags (zeros where it has none), cut to the logits' width, on
    the logits' device (the model runner keeps them there already)."""
    return values[:vocab].to(device) if values is not None else torch.zeros(vocab, dtype=dtype, device=device)
