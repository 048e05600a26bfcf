"""Greedy continuations from Hugging Face `generate`, and the tie-tolerant comparison with ours.

A flat batch sums in a different order than Hugging Face's layout, so a token may differ where
the two best logits are within TIE_TOLERANCE of each other; that case alone is allowed, printed,
and the comparison of that prompt stops there (the continuations then legitimately diverge)."""

from __future__ import annotations

import torch

TIE_TOLERANCE = 1e-4


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()


def assert_matches_up_to_ties(
    hf_model, prompt_ids: list[int], ours: list[int], theirs: list[int], label: str
) -> None:
    if ours == theirs:
        return
    position = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
    )
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + theirs[:position]])).logits[0, -1]
    top2 = logits.topk(2).values
    gap = (top2[0] - top2[1]).item()
    print(f"[{label}] divergence at output {position}: top-2 logit gap {gap:.2e}")
    assert gap < TIE_TOLERANCE, (label, position, ours, theirs)
