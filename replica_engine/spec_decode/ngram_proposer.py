"""Prompt lookup (vLLM's `method: ngram`): a request's own tokens as the draft model. The longest
suffix of the tokens so far, `min_n` to `max_n` tokens long, that also occurs earlier in them
proposes the tokens that followed that earlier occurrence. Code edits, quotes and repeated
structure copy long runs of the prompt, which the target then verifies in one step."""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` draft tokens, or none when no suffix of `min_n`..`max_n` tokens occurred before.
    The longest matching suffix wins; among its earlier occurrences, the latest (the most recent
    context is the likeliest to repeat), whose continuation is cut at the end of `tokens`."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        # An occurrence starting at `start` must end before the suffix itself begins to follow.
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + k])
    return []
