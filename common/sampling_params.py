"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.errors import InvalidRequestError


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float))) and not isinstance(value, bool) and math.isfinite(value)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what a torch generator's seed can hold


@dataclass
class SamplingParams:
    """What to generate for one request (vLLM's defaults: 16 tokens at temperature 1)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Not sampling, but per request all the same: requests share prefix-cache blocks only with
    # requests of the same salt (vLLM's cache_salt), so tenants cannot read each other's TTFT.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(
                "top_k", f"must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}"
            )
        if self.seed is not None and not (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX):
            raise InvalidRequestError("seed", f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop", "must be a non-empty string or a list of non-empty strings")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise InvalidRequestError("cache_salt", "must be a non-empty string")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "must be a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
