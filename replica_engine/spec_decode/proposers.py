"""Proposers: what guesses a request's next tokens, behind one interface the scheduler calls.

- `ngram` (prompt lookup): what followed the latest earlier occurrence of the request's last
  `prompt_lookup_min`..`prompt_lookup_max` tokens, in its own prompt and output.
- `draft_model`: a smaller model's greedy tokens (spec_decode/draft_model.py, built with the
  engine, which loads it).
- `suffix` (suffix decoding, after Arctic Inference): the longest suffix of the request's tokens
  (up to `suffix_decoding_max_tree_depth`) matched in its own tokens and, apart, in earlier
  requests' outputs (OutputCorpus); from every occurrence of it, the continuation most of them
  agree on, as long as the share agreeing stays at least `suffix_decoding_min_token_prob`, and
  at most `suffix_decoding_max_spec_factor` times the match's length. Of the two drafts, the one
  with more tokens expected kept. A suffix tree answers the same question; a scan of the request
  and a sorted pair index of the outputs answer it with numpy."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from replica_engine.request import Request
from replica_engine.spec_decode.config import SpeculativeConfig
from replica_engine.spec_decode.ngram_proposer import propose_ngram
from replica_engine.spec_decode.output_corpus import OutputCorpus
from replica_engine.spec_decode.suffix_match import suffix_draft


class Proposer(Protocol):
    def propose(self, limits: dict[Request, int]) -> dict[Request, list[int]]:
        """For each request, up to its limit of draft tokens to follow its tokens so far (none
        for some, maybe)."""
        ...

    def request_finished(self, request: Request) -> None:
        """A request ended (its output is final)."""
        ...

    def request_preempted(self, request: Request) -> None:
        """A request left the running batch to be recomputed later."""
        ...


class _PerRequest:
    """A proposer that drafts for each request alone, from its tokens (and what it keeps)."""

    def propose(self, limits: dict[Request, int]) -> dict[Request, list[int]]:
        return {request: self.propose_one(request, limit) for request, limit in limits.items()}

    def propose_one(self, request: Request, limit: int) -> list[int]:
        raise NotImplementedError

    def request_finished(self, request: Request) -> None:
        pass

    def request_preempted(self, request: Request) -> None:
        pass


class NgramProposer(_PerRequest):
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec

    def propose_one(self, request: Request, limit: int) -> list[int]:
        tokens = request.prompt_token_ids + request.output_token_ids
        return propose_ngram(tokens, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max, limit)


class SuffixProposer(_PerRequest):
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec
        self.corpus = OutputCorpus(spec.max_cached_requests)

    def propose_one(self, request: Request, limit: int) -> list[int]:
        spec = self.spec
        tokens = np.asarray(request.prompt_token_ids + request.output_token_ids, dtype=np.int64)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        own = suffix_draft(
            tokens, ends, tokens, spec.max_tree_depth, spec.max_spec_factor, limit, spec.min_token_prob
        )
        pattern = tokens[-spec.max_tree_depth :]
        earlier = self.corpus.draft(
            pattern, spec.max_tree_depth, spec.max_spec_factor, limit, spec.min_token_prob
        )
        return (earlier if earlier.score > own.score else own).token_ids

    def request_finished(self, request: Request) -> None:
        self.corpus.add(request.output_token_ids)


def make_proposer(spec: SpeculativeConfig) -> Proposer:
    """The proposer of a method that needs no model (a draft model's is built with the engine:
    spec_decode/draft_model.py)."""
    if spec.method == "draft_model":
        raise ValueError("a draft model's proposer is built with the engine, which loads it")
    return SuffixProposer(spec) if spec.method == "suffix" else NgramProposer(spec)
