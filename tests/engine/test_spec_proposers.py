"""Suffix decoding's search and the scheduler's pricing of drafts, alone: the draft follows the
continuation most occurrences of the longest matching suffix agree on (held to a definition
written out by hand), earlier requests' outputs are searched apart and forgotten oldest first,
and a step takes a draft token only while its expected worth pays for its time."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from common.sampling_params import SamplingParams
from replica_engine.request import Request
from replica_engine.scheduler.draft_pricing import DraftPricing
from replica_engine.scheduler.step_time_model import StepShape, StepTimeModel
from replica_engine.spec_decode import output_corpus
from replica_engine.spec_decode.config import SpeculativeConfig
from replica_engine.spec_decode.drafts import acceptance, record_verification
from replica_engine.spec_decode.output_corpus import OutputCorpus
from replica_engine.spec_decode.proposers import SuffixProposer
from replica_engine.spec_decode.suffix_match import suffix_draft


def _by_hand(
    source: list[int], cut: int, pattern: list[int], depth: int, factor: float, limit: int, min_prob: float
) -> list[int]:
    """The definition: the longest suffix of `pattern` (<= depth) occurring in source ending before
    `cut`, not across a -1; from all its occurrences, the most common next token (ties: the latest
    occurrence's), while the share of occurrences agreeing with the whole draft is >= min_prob."""
    for m in range(min(depth, len(pattern)), 0, -1):
        suffix = pattern[-m:]
        ends = [p for p in range(m - 1, cut) if source[p - m + 1 : p + 1] == suffix]
        if ends:
            break
    else:
        return []
    draft: list[int] = []
    alive, total = [p + 1 for p in ends], len(ends)
    while len(draft) < min(limit, int(factor * m)):
        alive = [p for p in alive if p < len(source)]
        if not alive:
            break
        counts = Counter(source[p] for p in alive)
        best = max(counts.values())
        token = [source[p] for p in alive if counts[source[p]] == best][-1]
        agreeing = [p for p in alive if source[p] == token]
        if token == -1 or len(agreeing) / total < min_prob:
            break
        draft.append(token)
        alive = [p + 1 for p in agreeing]
    return draft


def test_suffix_draft_follows_the_continuation_most_occurrences_agree_on():
    seq = np.array([1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 1, 2])
    ends = np.flatnonzero(seq[:-1] == seq[-1])
    draft = suffix_draft(seq, ends, seq, max_depth=4, spec_factor=4.0, limit=3, min_prob=0.1)
    assert draft.token_ids == [3, 9, 1]  # [1, 2] went on to 3 twice, to 4 once
    assert draft.score == pytest.approx(2 / 3 * 3)
    strict = suffix_draft(seq, ends, seq, max_depth=4, spec_factor=4.0, limit=3, min_prob=0.7)
    assert strict.token_ids == []  # two in three agree: below 0.7
    short = suffix_draft(seq, ends, seq, max_depth=4, spec_factor=0.5, limit=3, min_prob=0.1)
    assert short.token_ids == [3]  # half of a two-token match


def test_suffix_draft_follows_its_definition_on_random_sequences():
    rng = random.Random(7)
    for _ in range(500):
        seq = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        depth, factor, limit, min_prob = (
            rng.randrange(1, 6),
            rng.choice([0.5, 1.0, 3.0]),
            rng.randrange(1, 8),
            rng.choice([0.1, 0.4, 0.8]),
        )
        tokens = np.array(seq)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        got = suffix_draft(tokens, ends, tokens, depth, factor, limit, min_prob).token_ids
        assert got == _by_hand(seq, len(seq) - 1, seq, depth, factor, limit, min_prob), seq


@pytest.mark.parametrize("unsorted", [4096, 8], ids=["searched directly", "sorted as it goes"])
def test_earlier_outputs_are_searched_as_one_source_and_forgotten_oldest_first(unsorted: int, monkeypatch):
    monkeypatch.setattr(output_corpus, "MIN_UNSORTED", unsorted)
    rng = random.Random(3)
    corpus, kept = OutputCorpus(max_requests=5), []
    for _ in range(60):
        output = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
        corpus.add(output)
        kept = ([*kept, output])[-5:]
        source = [t for out in kept for t in (*out, -1)]
        pattern = [rng.randrange(5) for _ in range(rng.randrange(2, 6))]
        got = corpus.draft(np.array(pattern), 4, 2.0, 6, 0.2).token_ids
        expected = _by_hand(source, len(source), pattern, 4, 2.0, 6, 0.2)
        # the corpus matches two tokens at least: a one-token match drafts nothing there
        matched_two = any(source[p - 1 : p + 1] == pattern[-2:] for p in range(1, len(source)))
        assert got == (expected if matched_two else []), (kept, pattern)
    assert corpus.num_requests == 5 and corpus.num_tokens == sum(len(o) + 1 for o in kept)


def test_the_suffix_proposer_drafts_from_an_earlier_output_the_request_has_not_seen():
    spec = SpeculativeConfig.from_settings({"method": "suffix"})
    proposer = SuffixProposer(spec)
    earlier = Request("a", [1], SamplingParams(max_tokens=20))
    earlier.output_token_ids = [40, 41, 42, 43, 44, 45, 46, 47]
    proposer.request_finished(earlier)
    request = Request("b", [7, 8, 9, 40, 41, 42], SamplingParams(max_tokens=20))
    assert proposer.propose_one(request, limit=4) == [43, 44, 45]  # three: a three-token match
    request.output_token_ids = [43, 44, 45, 46]
    assert proposer.propose_one(request, limit=4) == [47]  # to the end of that output
    alone = SuffixProposer(
        SpeculativeConfig.from_settings({"method": "suffix", "suffix_decoding_max_cached_requests": 0})
    )
    alone.request_finished(earlier)
    assert alone.propose_one(request, limit=4) == []


def _request(name: str, kept: float, rejected: float, context: int = 100) -> Request:
    request = Request(name, [1] * context, SamplingParams(max_tokens=100))
    request.num_computed_tokens = context
    request.drafts_kept, request.drafts_rejected = kept, rejected
    return request


def test_a_request_whose_drafts_hold_is_expected_to_keep_more():
    request = _request("r", 1.0, 1.0)
    assert acceptance(request) == 0.5
    for _ in range(5):
        record_verification(request, drafted=4, kept=4)
    high = acceptance(request)
    assert high > 0.8
    record_verification(request, drafted=4, kept=0)
    assert acceptance(request) < high
    record_verification(request, drafted=0, kept=0)  # no draft: no evidence
    assert request.drafts_rejected == pytest.approx(0.9**6 + 1)


# A CPU-like step: 11 ms over the weights, 0.8 ms a token.
CPU_STEP = StepTimeModel.from_coefficients([0.011, 0.0008, 0.0004, 0.0, 0.0, 0.0004])


def _price(requests: list[Request], k: int, budget: int = 512) -> dict[str, int]:
    decodes = StepShape.of((r.num_computed_tokens, 1, True) for r in requests)
    pricing = DraftPricing.of(decodes, decodes, CPU_STEP)
    proposals = {r: [5] * k for r in requests if pricing.may_pay(r)}
    return {r.request_id: n for r, n in pricing.take(proposals, budget).items()}


def test_drafts_shrink_as_the_batch_grows_and_stop_where_they_cannot_pay():
    alone = _price([_request("a", 1.0, 1.0)], k=8)
    assert alone["a"] >= 3  # one decode: a token costs a fourteenth of the step
    sure = [_request(f"s{i}", 9.0, 1.0) for i in range(16)]
    unsure = [_request(f"u{i}", 1.0, 1.0) for i in range(16)]
    assert sum(_price(sure, k=8).values()) > 0
    assert _price(unsure, k=8) == {}  # a coin flip per token does not pay in a full batch
    decodes = StepShape.of((r.num_computed_tokens, 1, True) for r in unsure)
    assert not DraftPricing.of(decodes, decodes, CPU_STEP).may_pay(unsure[0])  # nor is one proposed
    mixed = _price([*sure[:8], *unsure[:8]], k=8)
    assert set(mixed) <= {r.request_id for r in sure}
    assert sum(_price(sure, k=8, budget=5).values()) == 5  # never past the budget


def test_drafts_never_take_a_step_past_its_tbt_target():
    request = _request("a", 9.0, 1.0)
    shape = StepShape.of([(100, 1, True)])
    assert DraftPricing.of(shape, shape, CPU_STEP).take({request: [5] * 8}, 512) == {request: 8}
    # 11.8 ms for the decode, 0.8 ms a draft token: 14.3 ms holds three of them
    within = DraftPricing.of(shape, shape, CPU_STEP, target_s=0.0143)
    assert within.take({request: [5] * 8}, 512) == {request: 3}


def test_without_a_step_time_model_the_budget_alone_bounds_drafts():
    request = _request("a", 1.0, 1.0)
    shape = StepShape.of([(100, 1, True)])
    unpriced = DraftPricing.of(shape, shape, None)
    assert unpriced.may_pay(request)
    assert unpriced.take({request: [5] * 6}, 4) == {request: 4}
