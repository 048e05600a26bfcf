"""Verifying a draft against the target model (Leviathan et al. 2023; Chen et al. 2023). The
target scores the request's last token and its k draft tokens in one step, giving k + 1
distributions. Greedy: a draft token stays while it is the target's argmax, and the first
mismatch is replaced by that argmax, so the output is token for token what decoding without a
draft gives. Sampled: draft token x (drawn from q) stays with probability min(1, p(x) / q(x));
the first rejected one is replaced by a draw from the residual max(p - q, 0), renormalised; when
every draft token stays, one more is drawn from the last distribution. Each emitted token is
then distributed exactly as p. A proposer without probabilities (prompt lookup) is a one-hot q:
x stays with probability p(x), and the residual is p without x."""

from __future__ import annotations

import torch


def verify_draft(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens a step emits for one request: the accepted draft tokens, then one from the
    target (the correction at the first rejection, or the bonus token after the last draft).
    `target_probs`: [k + 1, vocab], the target's processed distributions at the last token and
    at each draft token (greedy reads only their argmax: the logits will do); `draft_probs`:
    [k, vocab] (None: one-hot on the draft tokens)."""
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(
            f"target_probs has {target_probs.shape[0]} rows for {k} draft tokens; expected {k + 1}"
        )
    if greedy:
        best = target_probs.argmax(dim=-1).tolist()
        emitted: list[int] = []
        for position, token in enumerate(draft_tokens):
            if token != best[position]:
                return [*emitted, best[position]]
            emitted.append(token)
        return [*emitted, best[k]]
    uniforms = torch.rand(k, generator=generator, device=target_probs.device).tolist()
    for position, token in enumerate(draft_tokens):
        p = target_probs[position]
        q_token = float(draft_probs[position, token]) if draft_probs is not None else 1.0
        if uniforms[position] * q_token < float(p[token]):
            continue
        residual = (p - draft_probs[position]).clamp(min=0) if draft_probs is not None else p.clone()
        if draft_probs is None:
            residual[token] = 0
        if float(residual.sum()) <= 0:  # p == q up to rounding: nothing to correct towards
            residual = p
        correction = torch.multinomial(residual, 1, generator=generator).item()
        return [*draft_tokens[:position], int(correction)]
    bonus = torch.multinomial(target_probs[k], 1, generator=generator).item()
    return [*draft_tokens, int(bonus)]
