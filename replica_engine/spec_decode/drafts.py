"""Which decodes speculate, and their draft tokens: the scheduler's side of speculative decoding.
A request drafts when each token it samples depends on nothing but the model's distribution at
that position (temperature, top-k, top-p, min-p): verification then keeps its outputs exact.
Structured outputs, penalties, logit bias, logprobs and min_tokens still to reach make a token
depend on the ones before it in ways the verifier does not replay yet; those decode one token a
step."""

from __future__ import annotations

from replica_engine.request import Request
from replica_engine.spec_decode.config import SpeculativeConfig
from replica_engine.spec_decode.ngram_proposer import propose_ngram


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


def propose_drafts(request: Request, spec: SpeculativeConfig, room: int) -> list[int]:
    """Up to `room` draft tokens (what is left of the step's budget and of the request's
    max_tokens) for a request about to decode; none where it may not draft."""
    room = min(
        room,
        request.draft_length or spec.num_speculative_tokens,
        request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
    )
    if room < 1 or not may_draft(request):
        return []
    tokens = request.prompt_token_ids + request.output_token_ids
    return propose_ngram(tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, room)


def adapt_draft_length(request: Request, spec: SpeculativeConfig, drafted: int, kept: int) -> None:
    """After a verification, the next draft's length: one more than was kept, or twice as long
    when all of it was (up to the configured length). A request whose drafts keep failing then
    proposes one token at a time (a step computes one extra token for it, not k), and one whose
    drafts hold is back at k within a few steps."""
    if drafted:
        grown = 2 * drafted if kept == drafted else kept + 1
        request.draft_length = min(spec.num_speculative_tokens, grown)
