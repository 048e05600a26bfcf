"""Batched sampling. Each row's logits are first processed (logits_processors: bias, min_tokens,
penalties, grammar mask); logprobs, for rows that ask, are read from those processed logits,
before temperature, min-p, top-k and top-p (so a greedy row's logprob is the model's own
log-softmax when nothing else applies). Then greedy at temperature 0, else temperature, min-p,
top-k and top-p, with a per-request generator where a seed is given (so a seeded request
samples the same tokens whatever else shares its batch)."""

from __future__ import annotations

import torch

from replica_engine.executor import SampledTokens
from replica_engine.logits_processors import process_logits
from replica_engine.logprobs import token_logprobs
from replica_engine.scheduler.plan import SamplingRow


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus (both given per row)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= k[:, None]
    sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Drop a token once the tokens before it already cover top_p; the first always stays.
    covered = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    remove |= covered & (top_p < 1)[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampledTokens:
    """One token per row of `logits` ([num_requests, vocab], float32; changed in place)."""
    if all(row.is_plain for row in rows):
        token_ids = _sample(logits, rows)
        return SampledTokens(token_ids, [None] * len(rows))
    process_logits(logits, rows)
    token_ids = _sample(logits, rows)
    return SampledTokens(token_ids, token_logprobs(logits, rows, token_ids))


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    greedy_ids = logits.argmax(dim=-1)
    if all(r.params.greedy for r in rows):
        return greedy_ids.tolist()
    device = logits.device
    params = [r.params for r in rows]
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    logits = logits / temperature[:, None]
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):  # below min_p times the likeliest token's probability: out
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p; seeded rows use
    # their own generator.
    noise = torch.empty_like(probs).exponential_()
    for index, row in enumerate(rows):
        if row.generator is not None:
            noise[index].exponential_(generator=row.generator)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([p.greedy for p in params], device=device)
    return torch.where(is_greedy, greedy_ids, sampled).tolist()
