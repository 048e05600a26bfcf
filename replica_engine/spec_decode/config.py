"""`speculative_config`, by vLLM's names: which proposer guesses a request's next tokens, and how
many it may guess a step. Torch-free: the scheduler (and the fleet simulator's) reads it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common.errors import InvalidRequestError

FIELD = "speculative_config"
METHODS = ("ngram", "suffix", "draft_model")
# vLLM's other methods, refused by name until they are built here.
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
DEFAULT_LOOKUP_MAX = 5
# Suffix decoding's settings, with vLLM's defaults.
SUFFIX_DEFAULTS = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    # suffix: the longest suffix matched; earlier outputs kept (0: the request's own tokens
    # only); a draft's length at most this times the match's; a token's least path frequency.
    max_tree_depth: int = SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"]
    max_cached_requests: int = SUFFIX_DEFAULTS["suffix_decoding_max_cached_requests"]
    max_spec_factor: float = SUFFIX_DEFAULTS["suffix_decoding_max_spec_factor"]
    min_token_prob: float = SUFFIX_DEFAULTS["suffix_decoding_min_token_prob"]
    model: str | None = None  # draft_model: the draft (what `model` accepts), the target's vocabulary

    @classmethod
    def from_settings(cls, settings: Mapping[str, object]) -> SpeculativeConfig:
        """From the user's mapping; a bad or unknown key raises naming it
        (`speculative_config.<key>`)."""
        if not isinstance(settings, Mapping):
            raise InvalidRequestError(FIELD, f"must be a mapping of settings, got {settings!r}")
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "model",
            *SUFFIX_DEFAULTS,
        }
        for key in settings:
            if key not in known:
                raise InvalidRequestError(f"{FIELD}.{key}", f"unknown setting; known: {sorted(known)}")
        method = settings.get("method", "ngram" if "model" not in settings else "draft_model")
        if method in NOT_YET:
            raise InvalidRequestError(
                f"{FIELD}.method",
                f"{method!r} is not served yet; {METHODS} are (a draft model: 'draft_model')",
            )
        if method not in METHODS:
            raise InvalidRequestError(f"{FIELD}.method", f"must be one of {METHODS}, got {method!r}")
        if "model" in settings and method != "draft_model":
            raise InvalidRequestError(
                f"{FIELD}.model", f"a draft model is for method 'draft_model', not {method!r}"
            )
        if method == "suffix":
            return cls._suffix(settings)
        if method == "draft_model":
            model = settings.get("model")
            if not isinstance(model, str) or not model:
                raise InvalidRequestError(f"{FIELD}.model", f"a draft model is needed, got {model!r}")
            k = _count(settings.get("num_speculative_tokens"), "num_speculative_tokens", required=True)
            return cls(method, k, 1, DEFAULT_LOOKUP_MAX, model=model)
        k = _count(settings.get("num_speculative_tokens"), "num_speculative_tokens", required=True)
        lookup_max = _count(settings.get("prompt_lookup_max"), "prompt_lookup_max")
        lookup_min = _count(settings.get("prompt_lookup_min"), "prompt_lookup_min")
        # Unset: suffixes of 1 to 5 tokens (a lower bound above 5 alone raises the upper one to it).
        lookup_max = lookup_max or max(lookup_min, DEFAULT_LOOKUP_MAX)
        lookup_min = lookup_min or 1
        if lookup_min > lookup_max:
            raise InvalidRequestError(
                f"{FIELD}.prompt_lookup_min", f"{lookup_min} is above prompt_lookup_max ({lookup_max})"
            )
        return cls(method, k, lookup_min, lookup_max)

    @classmethod
    def _suffix(cls, settings: Mapping[str, object]) -> SpeculativeConfig:
        """Suffix decoding: k defaults to the tree depth, as vLLM's."""
        depth = _count(settings.get("suffix_decoding_max_tree_depth"), "suffix_decoding_max_tree_depth")
        depth = depth or SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"]
        cached = settings.get(
            "suffix_decoding_max_cached_requests", SUFFIX_DEFAULTS["suffix_decoding_max_cached_requests"]
        )
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            raise InvalidRequestError(
                f"{FIELD}.suffix_decoding_max_cached_requests",
                f"must be a non-negative integer, got {cached!r}",
            )
        factor = _fraction(settings, "suffix_decoding_max_spec_factor", upper=None)
        min_prob = _fraction(settings, "suffix_decoding_min_token_prob", upper=1.0)
        k = _count(settings.get("num_speculative_tokens"), "num_speculative_tokens") or depth
        return cls("suffix", k, 1, depth, depth, cached, factor, min_prob)


def _count(value: object, key: str, required: bool = False) -> int:
    """A positive integer setting; 0 when unset (and not required)."""
    if value is None and not required:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequestError(f"{FIELD}.{key}", f"must be a positive integer, got {value!r}")
    return value


def _fraction(settings: Mapping[str, object], key: str, upper: float | None) -> float:
    """A positive number setting (at most `upper`), its default when unset."""
    value = settings.get(key, SUFFIX_DEFAULTS[key])
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or value <= 0
        or (upper and value > upper)
    ):
        bound = f" and at most {upper}" if upper else ""
        raise InvalidRequestError(f"{FIELD}.{key}", f"must be a number above 0{bound}, got {value!r}")
    return float(value)
