"""Greedy continuations from Hugging Face `generate`, and the tie-tolerant comparison with ours.

A flat batch sums in a different order than Hugging Face's layout, so a token may differ where
the two best logits are within TIE_TOLERANCE of each other; that case alone is allowed, printed,
and the comparison of that prompt stops there (the continuations then legitimately diverge)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_TOLERANCE = 1e-4
# Short and long, prose, lists and code: what the exactness tests and bench.quality.quantization ask.
EXACTNESS_PROMPTS = [
    "The capital of France is",
    "Hello",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "List the planets of the solar system:",
    "Once upon a time in a land far away, there lived a king who had three daughters. The eldest was",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Water boils at 100 degrees Celsius at sea level. At the top of Mount Everest, water boils at "
    "a lower temperature because the air pressure is lower. Explain why, in simple terms:",
]


def _device(hf_model) -> torch.device:
    return next(hf_model.parameters()).device


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's greedy continuation of one prompt (a batch of one: no padding)."""
    return hf_greedy_batch(hf_model, [prompt_ids], max_new_tokens)[0]


def hf_greedy_batch(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """hf_greedy of each prompt, from one `generate` over them all: the weights are read once a
    token for the whole batch, not once a prompt (on a CPU the reference's whole cost). Rows are
    left-padded and masked; each row ends where generating it alone would have (its first end
    token), not with the padding `generate` appends to a finished row."""
    width = max(len(ids) for ids in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=_device(hf_model))
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=ids.device)
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
        )
    eos = hf_model.generation_config.eos_token_id
    ends = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for row in out[:, width:].tolist():
        stop = next((i + 1 for i, token in enumerate(row) if token in ends), len(row))
        rows.append(row[:stop])
    return rows


@dataclass(frozen=True)
class Divergence:
    position: int  # the first output token where ours and theirs differ
    top2_gap: float  # there, Hugging Face's gap between its two best logits


def first_divergence(
    hf_model, prompt_ids: list[int], ours: list[int], theirs: list[int]
) -> Divergence | None:
    if ours == theirs:
        return None
    position = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
    )
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + theirs[:position]], device=_device(hf_model))
        logits = hf_model(ids).logits[0, -1].float()
    top2 = logits.topk(2).values
    return Divergence(position, (top2[0] - top2[1]).item())


def assert_matches_up_to_ties(
    hf_model, prompt_ids: list[int], ours: list[int], theirs: list[int], label: str
) -> None:
    divergence = first_divergence(hf_model, prompt_ids, ours, theirs)
    if divergence is None:
        return
    print(f"[{label}] divergence at output {divergence.position}: top-2 logit gap {divergence.top2_gap:.2e}")
    assert divergence.top2_gap < TIE_TOLERANCE, (label, divergence.position, ours, theirs)
