"""Prompt lookup (vLLM's `method: ngram`): a request's own tokens as the draft model. The longest
suffix of the tokens so far, `min_n` to `max_n` tokens long, that also occurs earlier in them
proposes the tokens that followed that earlier occurrence. Code edits, quotes and repeated
structure copy long runs of the prompt, which the target then verifies in one step.

The search is suffix_match's, over the request's own tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from replica_engine.spec_decode.suffix_match import match_lengths


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
    matched = match_lengths(seq, ends, seq, max_n)
    if matched.max() < min_n:
        return []
    longest = min(int(matched.max()), max_n)
    start = int(ends[matched >= longest].max()) + 1
    return seq[start : start + k].tolist()
