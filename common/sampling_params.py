"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from common.errors import InvalidRequestError
from common.lora import LoRARequest
from common.structured_outputs import StructuredOutputs


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float))) and not isinstance(value, bool) and math.isfinite(value)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what a torch generator's seed can hold
MAX_LOGPROBS = 20  # top logprobs per token, as vLLM's default max_logprobs (OpenAI allows 20)
MAX_LOGIT_BIAS_ENTRIES = 1024


def wrap_int64(value: int) -> int:
    """Back into int64 range, as a seed near its top plus a choice index may leave it."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN


def _check_range(name: str, value: object, low: float, high: float) -> None:
    if not _is_number(value) or not low <= value <= high:  # type: ignore[operator]
        raise InvalidRequestError(name, f"must be a number in [{low}, {high}], got {value!r}")


def _check_count(name: str, value: int | None, high: int) -> None:
    if value is not None and not (_is_int(value) and 0 <= value <= high):
        raise InvalidRequestError(name, f"must be an integer in [0, {high}], got {value!r}")


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
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the text
    skip_special_tokens: bool = True  # special tokens have no text
    # Not sampling, but per request all the same: requests share prefix-cache blocks only with
    # requests of the same salt (vLLM's cache_salt), so tenants cannot read each other's TTFT.
    cache_salt: str | None = None
    # Penalties, as OpenAI and vLLM define them: presence and frequency subtract from the logits
    # of tokens already generated (once, and per occurrence); repetition divides positive logits
    # (multiplies negative ones) of tokens in the prompt or output. 0, 0 and 1 turn them off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p times the likeliest token's probability
    min_tokens: int = 0  # no stop token (eos, stop_token_ids) before this many output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # per output token: its logprob and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    structured_outputs: StructuredOutputs | None = None
    # Not sampling either: the scheduler admits lower values first (vLLM's priority; ties by arrival).
    priority: int = 0
    # The LoRA adapter to run with (None: the base model); the Ingress resolves `model` to it.
    lora: LoRARequest | None = None
    n: int = 1  # choices per prompt (LLM.generate, the API); the engine runs each as a request

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
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"must be true or false, got {getattr(self, name)!r}")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be a number > 0, got {self.repetition_penalty!r}"
            )
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}"
            )
        self._check_logit_bias()
        _check_count("logprobs", self.logprobs, MAX_LOGPROBS)
        _check_count("prompt_logprobs", self.prompt_logprobs, MAX_LOGPROBS)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise InvalidRequestError("structured_outputs", "must be a StructuredOutputs")
        if not _is_int(self.priority):
            raise InvalidRequestError("priority", f"must be an integer, got {self.priority!r}")
        if self.lora is not None and not isinstance(self.lora, LoRARequest):
            raise InvalidRequestError("lora", "must be a LoRARequest")
        if not _is_int(self.n) or self.n < 1:
            raise InvalidRequestError("n", f"must be an integer >= 1, got {self.n!r}")

    def for_choice(self, choice: int) -> SamplingParams:
        """Choice `choice` of n as a request of its own: n seeded choices must still differ
        (choice 0 keeps the seed the request checked)."""
        seed = self.seed if self.seed is None or not choice else wrap_int64(self.seed + choice)
        return dataclasses.replace(self, n=1, seed=seed)

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            self.logit_bias = {}
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                "logit_bias", f"must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to numbers"
            )
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise InvalidRequestError("logit_bias", f"keys must be token ids (>= 0), got {token_id!r}")
            _check_range("logit_bias", bias, -100.0, 100.0)

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the tokens so far (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
