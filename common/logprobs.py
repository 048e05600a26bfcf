"""One token's logprob and its likeliest alternatives: what the engine computes for requests that
ask (`logprobs`, `prompt_logprobs`) and the Ingress writes in OpenAI's shapes. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # -inf for a token the request's grammar or min_tokens ruled out
    rank: int  # 1: the likeliest token
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first, as many as asked
