"""Speculative decoding's pieces and the engine with them: prompt lookup proposes what followed
the latest earlier occurrence of the longest matching suffix; verification keeps greedy outputs
token for token and sampled outputs in the target's distribution (a chi-square test that rejects
a naive rule), seeded ones token for token too."""

from __future__ import annotations

import random
from collections.abc import Callable

import prometheus_client
import pytest
import torch

from common.errors import InvalidRequestError
from replica_engine import LLM, EngineConfig, LLMEngine, SamplingParams
from replica_engine.metrics import EngineMetrics, PrometheusSink
from replica_engine.spec_decode.ngram_proposer import propose_ngram
from replica_engine.spec_decode.rejection_sampler import verify_draft

pytestmark = pytest.mark.usefixtures("unpriced_drafts")  # tests/engine/conftest.py: why
VOCAB = 6
CHI2_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


def test_prompt_lookup_proposes_the_continuation_of_the_longest_latest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 2, 2, 2) == [4, 1]
    # [9, 2, 3] matches at index 4 only with n = 3; the 2-gram [2, 3] also occurs at 1 (followed by 5).
    assert propose_ngram([7, 2, 3, 5, 9, 2, 3, 8, 8, 9, 2, 3], 2, 3, 2) == [8, 8]
    assert propose_ngram([7, 2, 3, 5, 9, 2, 3, 8, 8, 9, 2, 3], 2, 2, 1) == [8]  # the latest [2, 3]
    assert propose_ngram([5, 6, 5, 6], 2, 4, 5) == [5, 6]  # cut at the end of the tokens
    assert propose_ngram([1, 2, 3, 4], 1, 3, 3) == []
    assert propose_ngram([3], 1, 3, 3) == []


def _lookup_by_hand(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, written out: longest suffix first, its latest earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return tokens[start + n : start + n + k]
    return []


def test_prompt_lookup_follows_its_definition_on_random_sequences():
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        assert propose_ngram(tokens, min_n, max_n, k) == _lookup_by_hand(tokens, min_n, max_n, k), tokens


def _bigram_model(seed: int) -> torch.Tensor:
    """A toy target: the next token's distribution depends on the last token only."""
    return torch.softmax(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3, dim=-1)


def test_greedy_verification_emits_what_greedy_decoding_does_whatever_the_draft():
    model = _bigram_model(0)
    plain = [0]
    for _ in range(40):
        plain.append(int(model[plain[-1]].argmax()))
    rng = random.Random(0)
    tokens = [0]
    while len(tokens) < len(plain):
        # Drafts right, wrong and half right: each step still emits greedy's next tokens.
        ahead = plain[len(tokens) : len(tokens) + 3]
        draft = [token if rng.random() < 0.6 else rng.randrange(VOCAB) for token in ahead]
        rows = model[torch.tensor([tokens[-1], *draft])]
        emitted = verify_draft(rows, draft, greedy=True)
        assert 1 <= len(emitted) <= len(draft) + 1
        tokens += emitted
    assert tokens[: len(plain)] == plain


Verify = Callable[[torch.Tensor, list[int], bool, torch.Generator], list[int]]


def _first_token_counts(rule: Verify, p: torch.Tensor, draws: int) -> torch.Tensor:
    """What the first emitted token is, over `draws` verifications of the draft token 2."""
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(VOCAB)
    rows = torch.stack([p, p])
    for _ in range(draws):
        counts[rule(rows, [2], False, generator)[0]] += 1
    return counts


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _naive_verify(
    target_probs: torch.Tensor, draft_tokens: list[int], greedy: bool, generator: torch.Generator
) -> list[int]:
    """Keeps the draft with probability p(x), as verification does, but replaces a rejected one
    with a draw from p itself rather than from p without x."""
    [token] = draft_tokens
    if float(torch.rand(1, generator=generator)) < float(target_probs[0, token]):
        return [token]
    return [int(torch.multinomial(target_probs[0], 1, generator=generator))]


def test_sampled_verification_keeps_the_targets_distribution():
    p = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)), dim=-1)
    draws = 20_000
    assert _chi_square(_first_token_counts(verify_draft, p, draws), p) < CHI2_DF5_P001
    # The same test tells a naive correction apart: it over-weights the draft token.
    assert _chi_square(_first_token_counts(_naive_verify, p, draws), p) > 10 * CHI2_DF5_P001


def test_every_accepted_draft_earns_a_bonus_token():
    certain = torch.nn.functional.one_hot(torch.tensor([3, 1, 4]), VOCAB).float()
    generator = torch.Generator().manual_seed(0)
    assert verify_draft(certain, [3, 1], greedy=False, generator=generator) == [3, 1, 4]
    with pytest.raises(ValueError, match="draft tokens"):
        verify_draft(certain, [3], greedy=True)


# -- in the engine ----------------------------------------------------------------------------
# Prompts that repeat themselves, so prompt lookup finds drafts that hold.
REPEATING = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Again: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3,",
    "The capital of France is",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}


def _greedy(prompts: list[str], max_tokens: int = 40, **settings: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(**settings)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    manager = llm.engine.core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks  # no block held after the last request
    return [list(o.outputs[0].token_ids) for o in outs], llm


SETTINGS = {
    "served": {},  # as served on this CPU: bfloat16 where native, the file's own 4-bit blocks
    "chunked": {"max_num_batched_tokens": 16},  # drafts beside prompt chunks, cut to the budget
    "preempting": {"num_kv_blocks": 8},  # a pool that preempts
    "float32": {"dtype": "float32", "quantization": "none", "enable_prefix_caching": False},
}
_plain: dict[str, list[list[int]]] = {}


@pytest.mark.parametrize(
    ("setting", "spec"),
    [(name, NGRAM) for name in SETTINGS] + [("served", SUFFIX), ("preempting", SUFFIX)],
    ids=[*(f"ngram-{name}" for name in SETTINGS), "suffix-served", "suffix-preempting"],
)
def test_greedy_outputs_are_the_same_tokens_with_speculation(setting: str, spec: dict):
    settings = SETTINGS[setting]
    if setting not in _plain:
        _plain[setting] = _greedy(REPEATING, **settings)[0]
    speculated, llm = _greedy(REPEATING, speculative_config=spec, **settings)
    assert speculated == _plain[setting]
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_accepted_tokens > 0, "no draft token was kept: the test did not speculate"
    assert scheduler.num_draft_tokens > scheduler.num_accepted_tokens  # and some were rejected
    if "num_kv_blocks" in settings:
        assert scheduler.num_preemptions > 0


def test_suffix_decoding_drafts_a_repeated_answer_from_the_earlier_one():
    """The same question twice, one at a time: the second answer is drafted from the first's
    output, kept by the engine; with no output kept, it drafts only from its own tokens. Both
    answers run their 40 tokens (ignore_eos): the model's first token here is a near-tie between
    a newline and the end of text, which the kernels' rounding may settle either way."""
    question = "Write a haiku about the sea."
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    kept = []
    for cached in (1, 0):
        llm = LLM(speculative_config={**SUFFIX, "suffix_decoding_max_cached_requests": cached})
        first = llm.generate([question], params)[0].outputs[0].token_ids
        scheduler = llm.engine.core.scheduler
        before = scheduler.num_accepted_tokens
        again = llm.generate([question], params)[0].outputs[0].token_ids
        assert again == first
        kept.append(scheduler.num_accepted_tokens - before)
    assert kept[0] >= len(first) // 2 > kept[1]


def test_requests_that_may_not_draft_decode_as_before_beside_those_that_do():
    """Penalties, logprobs and min_tokens change a token by the ones before it: those requests
    take no drafts, and their outputs are what they were, in a batch where others speculate."""
    special = [
        SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=0.5),
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=20),
        SamplingParams(max_tokens=24, temperature=0.0),
    ]
    runs = []
    for settings in ({}, {"speculative_config": NGRAM}):
        llm = LLM(**settings)
        outs = llm.generate(REPEATING, special)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert runs[1] == runs[0]


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_seeded_sampled_requests_draw_the_same_tokens_as_without_speculation(spec: dict):
    """Verification draws each position as plain decoding does, one draw per token, so a seeded
    request's tokens do not depend on how many drafts each step took; its lengths hold and its
    blocks come back."""
    params = [
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True) for i in range(4)
    ]
    plain = [o.outputs[0].token_ids for o in LLM().generate(REPEATING, params)]
    llm = LLM(speculative_config=spec)
    outs = [o.outputs[0].token_ids for o in llm.generate(REPEATING, params)]
    assert outs == plain
    assert [len(o) for o in outs] == [30] * 4
    assert llm.engine.core.scheduler.num_accepted_tokens > 0, "no draft was kept: not a test"
    manager = llm.engine.core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks


SPEC = "speculative_config"


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({SPEC: {"method": "eagle", "num_speculative_tokens": 2}}, f"{SPEC}.method"),
        ({SPEC: {"method": "mtp", "num_speculative_tokens": 2}}, f"{SPEC}.method"),
        ({SPEC: {"method": "ngram"}}, f"{SPEC}.num_speculative_tokens"),
        ({SPEC: {**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}}, f"{SPEC}.prompt_lookup_min"),
        ({SPEC: {**NGRAM, "lookahead": 2}}, f"{SPEC}.lookahead"),
        ({SPEC: {**SUFFIX, "suffix_decoding_min_token_prob": 1.5}}, f"{SPEC}.suffix_decoding_min_token_prob"),
        (
            {SPEC: {**SUFFIX, "suffix_decoding_max_cached_requests": -1}},
            f"{SPEC}.suffix_decoding_max_cached_requests",
        ),
        ({SPEC: {**SUFFIX, "suffix_decoding_max_tree_depth": 0}}, f"{SPEC}.suffix_decoding_max_tree_depth"),
        ({SPEC: NGRAM, "async_scheduling": True}, "async_scheduling"),
        ({SPEC: NGRAM, "tensor_parallel_size": 2}, SPEC),
    ],
)
def test_bad_speculative_settings_are_refused_by_name(settings: dict, named: str):
    with pytest.raises(InvalidRequestError) as raised:
        EngineConfig(**settings)
    assert raised.value.param == named


def test_the_metrics_count_drafts_kept_tokens_and_positions():
    registry = prometheus_client.CollectorRegistry()
    engine = LLMEngine(
        EngineConfig(speculative_config=NGRAM), EngineMetrics(PrometheusSink(registry), "smollm2")
    )
    for prompt in REPEATING:
        engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    scheduler = engine.core.scheduler

    def value(name: str, **labels: str) -> float:
        found = registry.get_sample_value(f"stallfree_{name}_total", {"model_name": "smollm2", **labels})
        return found or 0.0

    assert value("spec_decode_num_draft_tokens") == scheduler.num_draft_tokens > 0
    assert value("spec_decode_num_accepted_tokens") == scheduler.num_accepted_tokens > 0
    by_position = [value("spec_decode_num_accepted_tokens_per_pos", position=str(p)) for p in range(4)]
    assert sum(by_position) == scheduler.num_accepted_tokens
    assert by_position == sorted(
        by_position, reverse=True
    )  # a draft token is kept only after those before it
    assert value("spec_decode_num_drafts") <= value("spec_decode_num_draft_tokens")
    assert value("generation_tokens") == 30 * len(REPEATING)  # kept tokens counted as output
