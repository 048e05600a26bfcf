"""The requests a simulation serves."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from common.lora import LoRARequest

VOCAB_SIZE = 32000  # the token ids simulated outputs are drawn from


@dataclass(frozen=True)
class NextTurn:
    """A conversation's next turn: sent `think_s` after the last one's final token, its prompt
    the last prompt, the last turn's output and `user_token_ids` (a chat client resending the
    whole conversation)."""

    request_id: str
    think_s: float
    user_token_ids: tuple[int, ...]
    max_tokens: int
    next_turn: NextTurn | None = None


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # the output tokens it produces (as with ignore_eos: exactly this many)
    tenant: str = ""
    cache_salt: str | None = None
    next_turn: NextTurn | None = None  # sent once this one finishes (not if it fails)
    lora: str | None = None  # the LoRA adapter it runs with, by name (None: the base model)

    def __post_init__(self) -> None:
        name = f"request {self.request_id!r}"
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids: {name} has an empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: {name} asks for {self.max_tokens}, must be >= 1")
        if self.arrival_s < 0:
            raise ValueError(f"arrival_s: {name} arrives at {self.arrival_s}, must be >= 0")
        if self.next_turn is not None and self.next_turn.think_s < 0:
            raise ValueError(f"think_s: {name}'s next turn thinks {self.next_turn.think_s} s, must be >= 0")

    def follow_up(self, finished_s: float) -> SimRequest | None:
        """The conversation's next turn, once this one finished at `finished_s`."""
        turn = self.next_turn
        if turn is None:
            return None
        output = tuple(output_token(self.request_id, i) for i in range(self.max_tokens))
        prompt = self.prompt_token_ids + output + turn.user_token_ids
        arrival = finished_s + turn.think_s
        return SimRequest(
            turn.request_id,
            arrival,
            prompt,
            turn.max_tokens,
            self.tenant,
            self.cache_salt,
            turn.next_turn,
            self.lora,
        )

    @property
    def lora_request(self) -> LoRARequest | None:
        """Its adapter as the engine and the routers know one (the path only keys it: nothing is read)."""
        return None if self.lora is None else LoRARequest(self.lora, f"/sim/adapters/{self.lora}")


def output_token(request_id: str, index: int) -> int:
    """The token a simulated request produces at output position `index`: the same every run,
    different between requests (a conversation's next turn repeats the ones its last turn got)."""
    return zlib.crc32(f"{request_id}:{index}".encode()) % VOCAB_SIZE
