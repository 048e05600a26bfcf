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
    pattern's last tokens (at most `max_n`) each one matches, reading backwards: one comparison
    of every occurrence at every depth, then the run of agreement from the end."""
    back = np.arange(min(max_n, len(pattern)))
    places = ends[:, None] - back[None, :]
    agree = (places >= 0) & (source[np.maximum(places, 0)] == pattern[len(pattern) - 1 - back][None, :])
    return np.logical_and.accumulate(agree, axis=1).sum(axis=1)


def frequent_continuation(source: np.ndarray, starts: np.ndarray, limit: int, min_prob: float) -> Draft:
    """Up to `limit` tokens following the occurrences that start at `starts` (ascending), each the
    one that most of the occurrences still agreeing continue with (a tie goes to the latest), while
    the share of occurrences that agree with the whole draft so far is at least `min_prob`.
    Occurrences stop at the source's end and at END_OF_SEQUENCE."""
    tokens: list[int] = []
    score = 0.0
    total = len(starts)
    while len(tokens) < limit:
        starts = starts[starts < len(source)]
        if len(starts) == 1:  # one occurrence left: the rest of it, at one share
            return _one_occurrence(
                source, int(starts[0]), limit - len(tokens), 1 / total, min_prob, tokens, score
            )
        if not len(starts):
            break
        following = source[starts]
        latest = following[-1]
        if (following == latest).all():  # they agree: no count needed (the common case)
            token, agreeing = int(latest), np.ones(len(following), dtype=bool)
        else:
            _, inverse, counts = np.unique(following, return_inverse=True, return_counts=True)
            token = int(following[np.flatnonzero(counts[inverse] == counts.max())[-1]])
            agreeing = following == token
        share = int(agreeing.sum()) / total
        if token == END_OF_SEQUENCE or share < min_prob:
            break
        tokens.append(token)
        score += share
        starts = starts[agreeing] + 1
    return Draft(tokens, score)


def _one_occurrence(
    source: np.ndarray, start: int, limit: int, share: float, min_prob: float, tokens: list[int], score: float
) -> Draft:
    """`tokens` continued by what follows `start`, up to the end or END_OF_SEQUENCE, all at `share`."""
    if share < min_prob:
        return Draft(tokens, score)
    rest = source[start : start + limit]
    ends = np.flatnonzero(rest == END_OF_SEQUENCE)
    rest = rest[: ends[0]] if len(ends) else rest
    return Draft(tokens + rest.tolist(), score + share * len(rest))


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
