"""Which decodes speculate, and how far: the scheduler's side of speculative decoding.

A request drafts when each token it samples depends on nothing but the model's distribution at
that position (temperature, top-k, top-p, min-p): verification then keeps its outputs exact.
Structured outputs, penalties, logit bias, logprobs and min_tokens still to reach make a token
depend on the ones before it in ways the verifier does not replay yet; those decode one token a
step.

A request's j-th draft token is expected kept with probability a^j, where a is its share of
draft tokens kept so far (decayed, so it follows the text): the scheduler prices drafts with it
(scheduler/draft_pricing.py)."""

from __future__ import annotations

from replica_engine.request import Request

DECAY = 0.9  # per verification, of the counts a request's acceptance is estimated from
MAX_ACCEPTANCE = 0.95  # so a long run of kept drafts still prices later positions below earlier


def may_draft(request: Request) -> bool:
    params = request.sampling_params
    return (
        request.grammar is None
        and request.pooling is None
        and not request.num_in_flight_tokens
        and not params.logit_bias
        and not params.needs_token_history
        and params.logprobs is None
        and len(request.output_token_ids) >= params.min_tokens
    )


def record_verification(request: Request, drafted: int, kept: int) -> None:
    """What verification kept of a request's draft, for its acceptance estimate."""
    if drafted:
        request.drafts_kept = DECAY * request.drafts_kept + kept
        request.drafts_rejected = DECAY * request.drafts_rejected + (kept < drafted)


def acceptance(request: Request) -> float:
    """The estimated chance that each next draft token is kept (a prior of one half)."""
    kept = request.drafts_kept
    return min(MAX_ACCEPTANCE, kept / (kept + request.drafts_rejected))
