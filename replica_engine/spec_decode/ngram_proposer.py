"""Prompt lookup (vLLM's `method: ngram`): a request's own tokens as the draft model. The longest
suffix of the tokens so far, `min_n` to `max_n` tokens long, that also occurs earlier in them
proposes the tokens that followed that earlier occurrence. Code edits, quotes and repeated
structure copy long runs of the prompt, which the target then verifies in one step.

Vectorised over the sequence (a scheduler step runs it for every decode that may draft): the
candidates are the earlier places of the last token, and each step back narrows them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` draft tokens, or none when no suffix of `min_n`..`max_n` tokens occurred before.
    The longest matching suffix wins; among its earlier occurrences, the latest (the most recent
    context is the likeliest to repeat), whose continuation is cut at the end of `tokens`."""
    seq = np.asarray(tokens, dtype=np.int64)
    end = len(seq) - 1  # the last token's position
    # p: where an earlier occurrence of the suffix ends (its continuation starts at p + 1).
    ends = np.flatnonzero(seq[:end] == seq[end]) if end > 0 else np.empty(0, dtype=np.int64)
    if not len(ends):
        return []
    matched = np.ones(len(ends), dtype=np.int64)  # suffix tokens matched backwards from each p
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, end)):  # p - back >= 0, with p < end
        alive &= ends >= back
        alive[alive] = seq[ends[alive] - back] == seq[end - back]
        matched += alive
    if matched.max() < min_n:
        return []
    longest = min(int(matched.max()), max_n)
    start = int(ends[matched >= longest].max()) + 1
    return seq[start : start + k].tolist()
