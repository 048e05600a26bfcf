"""The requests a simulation serves."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

VOCAB_SIZE = 32000  # the token ids simulated outputs are drawn from


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # the output tokens it produces (as with ignore_eos: exactly this many)
    tenant: str = ""
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        name = f"request {self.request_id!r}"
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids: {name} has an empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: {name} asks for {self.max_tokens}, must be >= 1")
        if self.arrival_s < 0:
            raise ValueError(f"arrival_s: {name} arrives at {self.arrival_s}, must be >= 0")


def output_token(request_id: str, index: int) -> int:
    """The token a simulated request produces at output position `index`: the same every run,
    different between requests (a conversation's next turn repeats the ones its last turn got)."""
    return zlib.crc32(f"{request_id}:{index}".encode()) % VOCAB_SIZE
