"""bench.fleet.fleet_routing_validation's trace (bench.fleet.fleet's, written as text both sides agree on) and
its verdict on the simulator's router ratios."""

import itertools
import random
from pathlib import Path

import pytest

from bench.fleet.fleet_profiles import Profile, cpu_step_time
from bench.fleet.fleet_routing_validation import CONTEXT_TOKENS, as_text, judge, scaled_workload
from common.tokenizer import PromptTokenizer
from fleet_sim.replica import ReplicaConfig


@pytest.fixture(scope="module")
def written(model_dir: Path):
    tokenizer = PromptTokenizer.load(model_dir)
    profile = Profile("small", ReplicaConfig(num_kv_blocks=64), cpu_step_time(), 0.1, 128)
    requests = scaled_workload("b").requests(profile, 2, seed=0)
    return requests, as_text(requests, CONTEXT_TOKENS, tokenizer.encode, random.Random(0)), tokenizer


def test_the_text_trace_keeps_the_traces_arrivals_tenants_and_outputs(written):
    requests, texts, tokenizer = written
    assert len(texts) == len(requests) > 10
    for request, text in zip(requests, texts, strict=True):
        assert text.request.prompt_token_ids == tuple(tokenizer.encode(text.text))  # what a replica caches
        kept = ("request_id", "arrival_s", "max_tokens", "tenant", "next_turn")
        assert all(getattr(text.request, name) == getattr(request, name) for name in kept)


def test_a_tenants_requests_share_its_context_and_other_tenants_do_not(written):
    _, texts, _ = written
    by_tenant: dict[str, list] = {}
    for text in texts:
        by_tenant.setdefault(text.request.tenant, []).append(text.request.prompt_token_ids)
    assert len(by_tenant) > 2
    shared = [_common_prefix(a, b) for prompts in by_tenant.values() for a, b in itertools.pairwise(prompts)]
    assert shared and min(shared) >= 0.8 * CONTEXT_TOKENS  # the excerpt is sized in characters
    firsts = [prompts[0] for prompts in by_tenant.values()]
    assert max(_common_prefix(a, b) for a in firsts for b in firsts if a is not b) < 10


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _runs(*ttft_p90_s: float) -> list[dict]:
    return [{"ttft_p90_s": t} for t in ttft_p90_s]


def test_the_simulators_ratio_passes_within_25_percent_of_the_real_one_and_not_beyond():
    real = {"a": {"kv_prefix": _runs(1, 1, 1), "ray": _runs(2, 2, 2)}}  # 0.5
    close = {"a": {"kv_prefix": _runs(1.2, 1.2, 1.2), "ray": _runs(2, 2, 2)}}  # 0.6: +20%
    far = {"a": {"kv_prefix": _runs(1, 1, 1), "ray": _runs(1.4, 1.4, 1.4)}}  # 0.71: +43%
    ratios, met = judge(real, close, ("kv_prefix", "ray"))
    name = "(a) TTFT p90 kv_prefix / ray"
    assert ratios[name]["real"]["median"] == 0.5
    assert ratios[name]["error"] == pytest.approx(0.2)
    assert met == {f"{name}: simulated within 25% of real": True}
    assert judge(real, far, ("kv_prefix", "ray"))[1] == {f"{name}: simulated within 25% of real": False}
