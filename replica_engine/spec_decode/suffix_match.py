"""Matching a request's latest tokens against a token source, the search both prompt lookup and
suffix decoding share: where its last tokens occurred before, how far back each occurrence
agrees, and what followed them. Vectorised over the occurrences (numpy), because a scheduler
step runs it for every decode that may draft. A source may hold several sequences end to end,
each closed by END_OF_SEQUENCE, which no token equals: a match or a continuation stops there."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

END_OF_SEQUENCE = -1


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    score: float  # the expected number of them kept: the sum of each token's path frequency


NO_DRAFT = Draft([], 0.0)


def match_lengths(source: np.ndarray, ends: np.ndarray, pattern: np.ndarray, max_n: int) -> np.ndarray:
    """For occurrences of the pattern's last token ending at `ends` in `source`, how many of the
    pattern's last tokens (at most `max_n`) each one matches, reading backwards."""
    matched = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, len(pattern))):
        alive &= ends >= back
        alive[alive] = source[ends[alive] - back] == pattern[-1 - back]
        matched += alive
    return matched


def frequent_continuation(source: np.ndarray, starts: np.ndarray, limit: int, min_prob: float) -> Draft:
    """Up to `limit` tokens following the occurrences that start at `starts` (ascending), each the
    one that most of the occurrences still agreeing continue with (a tie goes to the latest), while
    the share of occurrences that agree with the whole draft so far is at least `min_prob`.
    Occurrences stop at the source's end and at END_OF_SEQUENCE."""
    tokens: list[int] = []
    share = score = 0.0
    total = len(starts)
    for _ in range(limit):
        starts = starts[starts < len(source)]
        if not len(starts):
            break
        following = source[starts]
        _, inverse, counts = np.unique(following, return_inverse=True, return_counts=True)
        latest_of_most = np.flatnonzero(counts[inverse] == counts.max())[-1]
        token = int(following[latest_of_most])
        agreeing = following == token
        share = int(agreeing.sum()) / total
        if token == END_OF_SEQUENCE or share < min_prob:
            break
        tokens.append(token)
        score += share
        starts = starts[agreeing] + 1
    return Draft(tokens, score)


def suffix_draft(
    source: np.ndarray,
    ends: np.ndarray,
    pattern: np.ndarray,
    max_depth: int,
    spec_factor: float,
    limit: int,
    min_prob: float,
) -> Draft:
    """The draft from the longest of the pattern's suffixes (at most `max_depth` tokens) that
    occurred in `source` ending at one of `ends`: from all its occurrences, at most `spec_factor`
    times its length and `limit` tokens, while they agree at least `min_prob` of the time."""
    if not len(ends):
        return NO_DRAFT
    matched = match_lengths(source, ends, pattern, max_depth)
    longest = int(matched.max())
    limit = min(limit, int(spec_factor * longest))
    if limit < 1:
        return NO_DRAFT
    return frequent_continuation(source, ends[matched == longest] + 1, limit, min_prob)
