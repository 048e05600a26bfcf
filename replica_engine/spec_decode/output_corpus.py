"""Earlier requests' outputs, for suffix decoding's cross-request drafts: an agent's tool calls,
a template's boilerplate and a retried answer repeat across requests, not within one.

The outputs lie end to end in one token array, each closed by END_OF_SEQUENCE, with an index of
every token pair's place sorted by the pair, so the places where a request's last two tokens
occurred are a binary search away. Outputs added since the last sort are searched directly;
sorting again once they are an eighth of the corpus keeps the work per token logarithmic. At most
`max_requests` outputs are kept, the oldest forgotten first (16 bytes a token)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from replica_engine.spec_decode.suffix_match import END_OF_SEQUENCE, NO_DRAFT, Draft, suffix_draft

MIN_UNSORTED = 4096  # tokens searched directly before the index is sorted again
MAX_OCCURRENCES = 4096  # of a pair, the latest, for one draft: bounds a step's work


def _pair_keys(tokens: np.ndarray) -> np.ndarray:
    """The key of each (tokens[i - 1], tokens[i]) pair, for i >= 1."""
    return (tokens[:-1].astype(np.int64) << 32) | (tokens[1:].astype(np.int64) & 0xFFFFFFFF)


class OutputCorpus:
    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self._tokens = np.empty(1024, dtype=np.int32)
        self._size = 0  # tokens in use
        self._start = 0  # tokens before it belong to forgotten outputs
        self._lengths: deque[int] = deque()  # each kept output's tokens, with its end, oldest first
        self._sorted_keys = np.empty(0, dtype=np.int64)  # pair keys of tokens < _indexed, sorted
        self._sorted_places = np.empty(0, dtype=np.int32)  # each pair's second token's place
        self._indexed = 0

    @property
    def num_requests(self) -> int:
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        return self._size - self._start

    def add(self, output_token_ids: Sequence[int]) -> None:
        """A finished request's output (nothing for an empty one)."""
        if not output_token_ids or self.max_requests < 1:
            return
        tokens = np.append(np.asarray(output_token_ids, dtype=np.int32), END_OF_SEQUENCE)
        if self._size + len(tokens) > len(self._tokens):
            self._tokens = np.resize(self._tokens, 2 * (self._size + len(tokens)))
        self._tokens[self._size : self._size + len(tokens)] = tokens
        self._size += len(tokens)
        self._lengths.append(len(tokens))
        while len(self._lengths) > self.max_requests:
            self._start += self._lengths.popleft()
        if self._size - self._indexed > max(MIN_UNSORTED, self.num_tokens // 8):
            self._sort()

    def _sort(self) -> None:
        """Drop the forgotten outputs and index every pair of what is left."""
        live = self._tokens[self._start : self._size].copy()
        self._tokens[: len(live)] = live
        self._size, self._start = len(live), 0
        keys = _pair_keys(live)
        order = np.argsort(keys, kind="stable")  # a pair's places stay ascending: latest last
        self._sorted_keys = keys[order]
        self._sorted_places = (order + 1).astype(np.int32)
        self._indexed = self._size

    def occurrences(self, first: int, second: int) -> np.ndarray:
        """Where the pair (first, second) ends in the kept outputs, ascending; the latest
        MAX_OCCURRENCES of them."""
        key = (np.int64(first) << 32) | (np.int64(second) & 0xFFFFFFFF)
        low, high = np.searchsorted(self._sorted_keys, [key, key + 1])
        places = self._sorted_places[low:high].astype(np.int64)
        tail = self._tokens[max(self._indexed - 1, 0) : self._size]
        recent = np.flatnonzero((tail[:-1] == first) & (tail[1:] == second)) + max(self._indexed, 1)
        places = np.concatenate([places, recent])
        return places[places > self._start][-MAX_OCCURRENCES:]  # none in a forgotten output

    def draft(
        self, pattern: np.ndarray, max_depth: int, spec_factor: float, limit: int, min_prob: float
    ) -> Draft:
        """Suffix decoding's draft for a request whose tokens end with `pattern`, from the outputs
        kept here; a match needs the last two tokens at least."""
        if len(pattern) < 2 or not self.num_tokens:
            return NO_DRAFT
        ends = self.occurrences(int(pattern[-2]), int(pattern[-1]))
        tokens = self._tokens[: self._size]
        return suffix_draft(tokens, ends, pattern, max_depth, spec_factor, limit, min_prob)
