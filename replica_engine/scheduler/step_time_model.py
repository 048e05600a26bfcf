"""A replica's step-time model: how long a step of a given composition takes on this machine.

time = c0 + c_prefill * prefill tokens + c_decode * decode requests + c_prompt_attention *
query-key pairs of prompt chunks + c_decode_attention * query-key pairs of decodes + c_request *
requests [+ c_experts * experts read, for a mixture of experts]. Linear layers cost per token
(and c0 is the pass over the weights), attention per
query-key pair it scores (a chunk of n tokens after s cached ones scores n*s + n(n+1)/2 pairs; a
decode at context L scores L), and each request adds its own host and sampling work. Prompt
chunks and decodes price their pairs apart: a chunk's attention is a matrix product (compute-bound
on a GPU), a decode's reads each key and value once for one query (bound by memory), tens of
times slower per pair on a GPU. Fitted by least squares (coefficients kept non-negative, so more work never
predicts less time) on a startup profile plus a window of measured steps, refitted every few
steps; a quantile of measured/predicted over the window then calibrates it, so a noisy host
makes the model cautious rather than wrong on average.

A mixture of experts reads only the experts its step's tokens pick, more as the batch grows until
it reads them all: not linear in the tokens, so it gets a feature of its own, the expected count
of distinct experts a layer's tokens pick (under uniform routing: ExpertRouting). Routers are
sent the six shape coefficients alone (they price one prompt's tokens, not a step's experts)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

NUM_FEATURES = 6  # of a StepShape; a mixture of experts' model has one more
# The startup profile's shapes (replica_engine/step_profile.py times them on the model).
CHUNK_SIZES = (16, 64, 256, 1024, 2048)
DECODE_BATCHES = (1, 4, 16, 64)
CONTEXTS = (64, 512, 2048)  # decodes' attention grows with context: long ones too

# A shape is (start, tokens, is decode) per request.
Rows = list[tuple[int, int, bool]]


@dataclass(frozen=True)
class StepShape:
    """What a step's time is predicted from."""

    num_prefill_tokens: int = 0
    num_decodes: int = 0
    num_prompt_attention_pairs: int = 0
    num_requests: int = 0
    num_decode_attention_pairs: int = 0

    @staticmethod
    def of(rows: Iterable[tuple[int, int, bool]]) -> StepShape:
        """From (start position, tokens, is decode) per request. Plain counters, not `plus` per
        row: every step's summary computes its shape, and a StepShape a row cost ~0.6 us a row."""
        num_prefill_tokens = num_decodes = prompt_pairs = num_requests = decode_pairs = 0
        for start, num_tokens, is_decode in rows:
            if num_tokens <= 0:
                continue
            num_requests += 1
            if is_decode:
                num_decodes += 1
                decode_pairs += attention_pairs(start, num_tokens)
            else:
                num_prefill_tokens += num_tokens
                prompt_pairs += attention_pairs(start, num_tokens)
        return StepShape(num_prefill_tokens, num_decodes, prompt_pairs, num_requests, decode_pairs)

    def plus(self, start: int, num_tokens: int, is_decode: bool = False) -> StepShape:
        """This step with one more request's `num_tokens` tokens at positions start.. ."""
        if num_tokens <= 0:
            return self
        pairs = attention_pairs(start, num_tokens)
        return StepShape(
            self.num_prefill_tokens + (0 if is_decode else num_tokens),
            self.num_decodes + (1 if is_decode else 0),
            self.num_prompt_attention_pairs + (0 if is_decode else pairs),
            self.num_requests + 1,
            self.num_decode_attention_pairs + (pairs if is_decode else 0),
        )

    def features(self) -> np.ndarray:
        return np.array(
            [
                1.0,
                self.num_prefill_tokens,
                self.num_decodes,
                self.num_prompt_attention_pairs,
                self.num_decode_attention_pairs,
                self.num_requests,
            ]
        )


@dataclass(frozen=True)
class ExpertRouting:
    """A mixture of experts' routing: each token picks `top_k` of `num_experts` per sparse layer."""

    num_experts: int
    top_k: int

    def expected_touched(self, num_tokens: int) -> float:
        """Distinct experts a layer's `num_tokens` tokens pick, on average, were routing uniform
        (a trained router is skewed: fewer)."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** num_tokens)


class StepTime(Protocol):
    """What a step of a given shape takes: the fitted StepTimeModel, or a GPU's roofline where
    none can be measured (fleet_sim/roofline.py)."""

    def predict_raw(self, shape: StepShape) -> float:
        """The expected time."""
        ...

    def predict(self, shape: StepShape) -> float:
        """A time most steps of the shape stay within (what a TBT budget plans with)."""
        ...


def profile_shapes(cap: int, max_len: int, max_seqs: int, prompts: bool = True) -> list[Rows]:
    """Every profile shape within the budget `cap`, `max_seqs` and the context (positions < max_len);
    decodes alone without `prompts` (what pricing draft tokens needs, in a third of the time)."""
    largest = min(cap, max_len)
    chunks = sorted({c for c in CHUNK_SIZES if c < largest} | {largest}) if prompts else []
    batches = [b for b in DECODE_BATCHES if b <= min(cap, max_seqs)]
    shapes: list[Rows] = []
    for context in CONTEXTS:
        shapes += [[(context if context + c <= max_len else 0, c, False)] for c in chunks]
        shapes += [[(min(context, max_len - 1), 1, True)] * b for b in batches]
    mixed_decodes = min(8, cap // 2, max_seqs - 1)
    if mixed_decodes > 0 and prompts:
        decode = (min(256, max_len - 1), 1, True)
        shapes.append([decode] * mixed_decodes + [(0, min(cap - mixed_decodes, max_len), False)])
    return shapes


def attention_pairs(start: int, num_tokens: int) -> int:
    """Query-key pairs causal attention scores for `num_tokens` tokens after `start` cached ones."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepTimeModel:
    def __init__(
        self,
        window: int = 512,
        refit_every: int = 32,
        quantile: float = 0.95,
        experts: ExpertRouting | None = None,
    ) -> None:
        self.refit_every = refit_every
        self.quantile = quantile
        self.experts = experts
        self.coefficients = np.zeros(NUM_FEATURES + (experts is not None))
        self.calibration = 1.0  # the quantile of measured / predicted
        self._profile: list[tuple[np.ndarray, float]] = []
        self._window: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._since_fit = 0

    @classmethod
    def from_coefficients(cls, coefficients: Iterable[float], calibration: float = 1.0) -> StepTimeModel:
        """A model fitted elsewhere (another replica's profile, a file): c0, c_prefill, c_decode,
        c_prompt_attention, c_decode_attention, c_request, in seconds."""
        model = cls()
        values = np.array(list(coefficients), dtype=float)
        if values.shape != (NUM_FEATURES,) or (values < 0).any() or calibration <= 0:
            raise ValueError(f"coefficients: {NUM_FEATURES} non-negative seconds and a positive calibration")
        model.coefficients, model.calibration = values, calibration
        return model

    def fit_profile(self, samples: Iterable[tuple[StepShape, float]]) -> None:
        """The startup profile: kept for good, so the fit stays determined however narrow the
        recent steps are (a window of decode-only steps says nothing of prompt chunks)."""
        self._profile = [(self.features(shape), seconds) for shape, seconds in samples]
        self.refit()

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A measured step; the model refits every `refit_every` of them."""
        self._window.append((self.features(shape), seconds))
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self.refit()

    def features(self, shape: StepShape) -> np.ndarray:
        if self.experts is None:
            return shape.features()
        touched = self.experts.expected_touched(shape.num_prefill_tokens + shape.num_decodes)
        return np.append(shape.features(), touched)

    @property
    def shape_coefficients(self) -> tuple[float, ...]:
        """The six of a StepShape's features (what routers are sent)."""
        return tuple(float(c) for c in self.coefficients[:NUM_FEATURES])

    def predict_raw(self, shape: StepShape) -> float:
        return float(self.features(shape) @ self.coefficients)

    def predict(self, shape: StepShape) -> float:
        """The calibrated prediction: most steps of this shape take at most this long."""
        return self.predict_raw(shape) * self.calibration

    def refit(self) -> None:
        self._since_fit = 0
        samples = self._profile + list(self._window)
        if not samples:
            return
        features = np.stack([f for f, _ in samples])
        seconds = np.array([s for _, s in samples])
        self.coefficients = _non_negative_least_squares(features, seconds)
        recent = slice(len(self._profile) if self._window else 0, None)  # the window, else the profile
        ratios = seconds[recent] / np.maximum(features[recent] @ self.coefficients, 1e-9)
        self.calibration = float(np.quantile(ratios, self.quantile))


def _non_negative_least_squares(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares, dropping the most negative coefficient until none is: a greedy
    non-negative fit (not Lawson-Hanson's optimum), enough for six features."""
    active = list(range(features.shape[1]))
    coefficients = np.zeros(features.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(features[:, active], seconds, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            return coefficients
        del active[int(np.argmin(solution))]
    return coefficients
