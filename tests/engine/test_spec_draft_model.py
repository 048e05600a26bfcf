"""A draft model proposes, the target verifies: greedy outputs are the target's own tokens whether
the draft is the target itself (nearly every draft kept) or a tiny random model of the same
vocabulary (nearly every draft rejected), through chunks and preemption; the draft's pool and
rows are given back when requests end; a draft that cannot serve the target is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.errors import InvalidRequestError
from common.model_source import DEFAULT_MODEL
from replica_engine import LLM, EngineConfig, SamplingParams
from tests.engine.test_models import TINY

PROMPTS = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Again: apple, banana,",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
]
EXACT = {"dtype": "float32", "quantization": "none"}


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> Path:
    """Two layers of random weights with SmolLM2's vocabulary and context: a draft that is nearly
    always wrong."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "max_position_embeddings": 8192})
    path = tmp_path_factory.mktemp("tiny_draft")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def plain() -> dict[str, list[list[int]]]:
    """The target's greedy outputs without speculation, by pool setting."""
    return {}


def _greedy(settings: dict) -> tuple[list[list[int]], LLM]:
    llm = LLM(**EXACT, **settings)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0))
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.parametrize(
    ("draft", "pool"),
    [("target", {}), ("tiny", {}), ("tiny", {"num_kv_blocks": 8, "max_num_batched_tokens": 16})],
    ids=["self-draft", "random-draft", "random-draft-preempting-chunked"],
)
def test_greedy_outputs_are_the_targets_tokens_whatever_the_draft(draft, pool, tiny_draft, plain):
    key = str(sorted(pool.items()))
    if key not in plain:
        plain[key] = _greedy(pool)[0]
    model = DEFAULT_MODEL if draft == "target" else str(tiny_draft)
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 4}
    speculated, llm = _greedy({**pool, "speculative_config": spec})
    assert speculated == plain[key]
    scheduler = llm.engine.core.scheduler
    kept, drafted = scheduler.num_accepted_tokens, scheduler.num_draft_tokens
    assert drafted > 0, "nothing was drafted: not a test"
    if draft == "target":
        assert kept >= 0.8 * drafted  # the target drafting for itself: kept but for near-ties
    else:
        assert kept <= 0.2 * drafted
    if pool:
        assert scheduler.num_preemptions > 0
    proposer = scheduler.proposer
    assert proposer.states == {}  # every request's draft state given back with its end
    assert proposer.num_free_blocks == llm.engine.core.kv_cache_manager.num_blocks
    manager = llm.engine.core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_a_draft_model_that_cannot_serve_the_target_is_refused_by_name():
    draft = {"method": "draft_model", "num_speculative_tokens": 4}
    with pytest.raises(InvalidRequestError) as raised:
        LLM(speculative_config={**draft, "model": "dummy:llama3-8b"})
    assert raised.value.param == "speculative_config.model"
    assert "128256" in str(raised.value)  # its vocabulary, against the target's
    with pytest.raises(InvalidRequestError) as raised:
        LLM(speculative_config={**draft, "model": "/no/such/draft"})
    assert raised.value.param == "speculative_config.model"
    lookup = {"method": "ngram", "num_speculative_tokens": 4}
    for settings, named in (
        (draft, "speculative_config.model"),
        ({**lookup, "model": DEFAULT_MODEL}, "speculative_config.model"),
        ({"model": DEFAULT_MODEL}, "speculative_config.num_speculative_tokens"),
    ):
        with pytest.raises(InvalidRequestError) as raised:
            EngineConfig(speculative_config=settings)
        assert raised.value.param == named


@pytest.mark.parametrize("spec", ["suffix", "draft_model"])
def test_a_request_aborted_while_speculating_gives_back_every_block(spec: str):
    """Aborted between steps that carry its drafts: the target's pool, the draft's pool and its
    rows come back, and the request beside it finishes with the tokens it has alone."""
    settings = {"method": "suffix"} if spec == "suffix" else {"method": spec, "model": DEFAULT_MODEL}
    llm = LLM(**EXACT, speculative_config={"num_speculative_tokens": 4, **settings})
    engine, params = llm.engine, SamplingParams(max_tokens=24, temperature=0.0)
    counting = engine.add_request("1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2,", params)
    other = engine.add_request(PROMPTS[2], params)
    scheduler, before = engine.core.scheduler, []
    while scheduler.num_draft_tokens == 0:  # until a step has verified drafts
        before += engine.step()
    assert engine.abort_request(counting).finish_reason == "abort"
    after = []
    while engine.has_unfinished_requests():
        after += engine.step()
    assert {o.request_id for o in after} == {other}  # the aborted request never comes back
    alone = LLM(**EXACT).generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    assert [t for o in before + after if o.request_id == other for t in o.new_token_ids] == list(alone)
    manager = engine.core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    if spec == "draft_model":
        assert scheduler.proposer.states == {}
        assert scheduler.proposer.num_free_blocks == manager.num_blocks
