"""Verifying a draft against the target model (Leviathan et al. 2023; Chen et al. 2023). The
target scores the request's last token and its k draft tokens in one step, giving k + 1
distributions. At each position in turn the step draws the token exactly as decoding without a
draft would (greedy: the argmax; sampled: sampler.py's draw, with the request's own generator,
one draw per position), and a draft token stays while it equals that draw; the
first draw that differs, or the one after the last draft, ends the step's tokens.

For a proposer without probabilities (prompt lookup, suffix decoding, a greedy draft model: a
one-hot q) this is rejection sampling: draft x stays with probability p(x), and a rejected
position emits a draw from p conditioned on not x, the residual. And it is more: the draws are
those plain decoding makes, one per emitted token, so a seeded request's tokens are the same
with speculation as without, whatever the draft and however long."""

from __future__ import annotations

import torch

from replica_engine.sampler import inverse_cdf


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` ([vocab]) as the sampler draws it: one uniform number from the
    request's generator, through sampler.inverse_cdf."""
    uniform = torch.rand((), generator=generator, device=probs.device)
    return int(inverse_cdf(probs[None], uniform[None])[0])


def verify_draft(
    scores: torch.Tensor,
    draft_tokens: list[int],
    greedy: bool,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens a step emits for one request: the draft tokens kept, then the target's (at the
    first mismatch, or after the last draft). `scores`: [k + 1, vocab], the logits (greedy) or
    the processed distributions (sampled) at the last token and at each draft token."""
    k = len(draft_tokens)
    if scores.shape[0] != k + 1:
        raise ValueError(f"scores has {scores.shape[0]} rows for {k} draft tokens; expected {k + 1}")
    best = scores.argmax(dim=-1).tolist() if greedy else None
    emitted: list[int] = []
    for position in range(k + 1):
        token = best[position] if best is not None else draw(scores[position], generator)
        emitted.append(token)
        if position == k or token != draft_tokens[position]:
            return emitted
    raise AssertionError("unreachable")
