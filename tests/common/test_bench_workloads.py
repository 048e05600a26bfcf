"""Every benchmark's workload generator makes the same requests as when these hashes were recorded
(before bench/ moved onto one driver): a sha256 of each workload's canonical JSON (prompt token
ids, lengths, arrival times, in order). No Ray, no model: text comes from a fixed stand-in text
and a stand-in tokenizer, so the hashes depend on the generators' draws alone."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from bench import chat_workload
from bench.driver import uniform_workload
from bench.engine import capacity_run, prefix
from bench.quality import dtype_agreement
from bench.serving import cpu_serving, router
from harness.random_workload import random_tokens
from harness.soak_load import soak_workload

STAND_IN_TEXT = "".join(f"word{i} " for i in range(20000))
VOCAB_SIZE = 49152  # SmolLM2's
RECORDED = {
    "capacity": "7e5c217722aa2d2e4b51c0c1f056dbd4ccface7b90093a81b93126445fda7dfd",
    "capacity_decode_batch": "388bf7717ba2bee4aaf8a61ad32acad26fd796e1c6ad52be15888b07fb20c7cb",
    "prefix": "3cf7d4231161396a985aa51b0c7735858079336e89363ebcb8e7aa276876ffa1",
    "cpu_serving": "38e36b204367816780cb9770c08ccd9224891692967e0b3f2a49a69b5abfeb8e",
    "router": "7e1df2b73cd622e3aa9f423a8b00d538d196f5710a888bf2226c073963af6534",
    "soak": "865a26f332ed081bec08bb1756ee19dfa7d0b172944823702fe29a4a27e2d481",
    "offline": "8be5ee10438ec84ae2ac3283c9b0f47380239596afff53a2fade10c6318eac1c",
    "dtype_agreement": "c6a227179346965ea14746ad51111d21739583d2ec3bd21897f63db51d1ee6bd",
}


class StandInTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(range(5000, 25000))


def digest(workload: object) -> str:
    return hashlib.sha256(json.dumps(workload, separators=(",", ":")).encode()).hexdigest()


def arrivals(workload: list) -> list[list]:
    return [[a.at_s, a.prompt, a.max_tokens] for a in workload]


def capacity() -> object:
    return [arrivals(capacity_run.workload(n, s)) for n, s in ((256, 0), (256, 1), (256, 2), (96, 0))]


def capacity_decode_batch() -> object:
    rng = random.Random(7)
    return [[0.0, random_tokens(rng, 512), 48] for _ in range(8)]


def prefix_workloads() -> object:
    def turns(workload: list) -> list:
        assert {t.max_tokens for t in workload} == {prefix.OUTPUT_TOKENS}
        return [[t.at_s, t.prompt] for t in workload]

    def chats(workload: list) -> list:
        return [[c.at_s, c.system, c.messages] for c in workload]

    return [
        *[turns(prefix.shared_prefix(s, 1.0)) for s in (0, 1, 2)],
        turns(prefix.shared_prefix(0, None)),
        *[chats(prefix.conversations(s, 0.5)) for s in (0, 1, 2)],
        chats(prefix.conversations(0, None)),
        turns(prefix.no_shared(0)),
        turns(prefix.no_shared(99)[:4]),
    ]


def cpu_serving_workloads() -> object:
    base = cpu_serving.workload(0, StandInTokenizer())
    return [arrivals(base), *[arrivals(cpu_serving.poisson(base, s)) for s in (0, 1, 2)]]


def router_workloads(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setattr(chat_workload, "english_text", lambda: STAND_IN_TEXT)
    chats = [
        [[c.tenant, c.user, c.at_s, c.system, c.questions, c.think_s]
         for c in chat_workload.multi_tenant_chat(s, **router.CHAT)]
        for s in (0, 1, 2)
    ]  # fmt: skip
    loads = [arrivals(router.load_workload(kind, s)) for kind in ("skewed", "uniform") for s in (0, 1, 2)]
    return [*loads, chats]


def soak_workloads() -> object:
    return [
        [[r.prompt_token_ids, r.max_tokens, r.disconnect_after_chunks] for r in soak_workload(*args)]
        for args in ((1000, VOCAB_SIZE, 0.1, 0), (1000, 512, 0.1, 7))
    ]


def offline() -> object:
    workload = uniform_workload(32, (16, 512), (16, 128), (100, VOCAB_SIZE - 100), 0)
    return [workload.prompts, workload.output_lens]


def dtype_agreement_prompts() -> object:
    return dtype_agreement.held_prompts(StandInTokenizer(), 64, 0)


def test_benchmark_workloads_are_the_recorded_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    made = {
        "capacity": capacity(),
        "capacity_decode_batch": capacity_decode_batch(),
        "prefix": prefix_workloads(),
        "cpu_serving": cpu_serving_workloads(),
        "router": router_workloads(monkeypatch),
        "soak": soak_workloads(),
        "offline": offline(),
        "dtype_agreement": dtype_agreement_prompts(),
    }
    assert {name: digest(workload) for name, workload in made.items()} == RECORDED


class CharTokenizer:
    """A stand-in that encodes each character as its code: prompts whose pieces are recognisable."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_eval_scorings_requests_are_a_harness_scoring_shared_contexts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # lm-eval's shape: per subject one few-shot header; per question one context; per choice one
    # request, the context then the choice; and the answer, each question's likeliest choice.
    from bench.serving import eval_scoring

    monkeypatch.setattr("bench.text_prompts.english_text", lambda: STAND_IN_TEXT)
    requests = eval_scoring.workload(CharTokenizer())
    subjects, questions, choices = eval_scoring.SUBJECTS, eval_scoring.QUESTIONS, eval_scoring.CHOICES
    assert len(requests) == subjects * questions * len(choices)
    for first in range(0, len(requests), len(choices)):
        group = requests[first : first + len(choices)]
        assert len({r.question for r in group}) == 1
        assert all(r.prompt[: r.context_len] == group[0].prompt[: group[0].context_len] for r in group)
        assert ["".join(map(chr, r.prompt[r.context_len :])) for r in group] == list(choices)
    per_subject = questions * len(choices)
    for subject in range(subjects):
        contexts = [r.prompt for r in requests[subject * per_subject : (subject + 1) * per_subject]]
        header = "".join(map(chr, contexts[0])).split("Answer:")[: eval_scoring.SHOTS]
        assert all("".join(map(chr, c)).split("Answer:")[: eval_scoring.SHOTS] == header for c in contexts)
    logprobs = [-1.0, -0.5, -2.0, -3.0] * subjects * questions
    logprobs[4:8] = [-4.0, -3.0, -2.0, -0.1]
    assert eval_scoring.choices(requests, logprobs)[:3] == [1, 3, 1]
