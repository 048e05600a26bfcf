"""`python -m bench eval_scoring`: an evaluation harness scoring multiple-choice questions against
the server, as lm-eval's `local-completions` does, stallfree beside vLLM CPU.

lm-eval scores each choice of a question with a request of its own: the context (the few-shot
examples, then the question) followed by the choice, sent as token ids with `echo: true,
logprobs: 1, max_tokens: 1, temperature: 0` (its payload for loglikelihood), and reads the
choice's logprob from the echoed prompt's. Such requests ask for prompt logprobs. vLLM computes
their whole prompt: it reads nothing from its prefix cache for them. stallfree keeps prompt
logprobs with the blocks of its prefix cache, and a request whose prefix another one is computing
waits for it, so a question's context is computed once for its four choices, and a subject's
few-shot examples once for all its questions.

Workload, MMLU's shape (lm-eval's 5-shot `mmlu` tasks), from English text (bench.text_prompts;
what the model answers does not matter here, only the work): 2 subjects, each a 5-shot header
(the same for every question of the subject, as lm-eval takes a subject's first dev examples;
~100 tokens an example), 12 questions of ~100 tokens, choices " A" " B" " C" " D": 96 requests
of ~620 tokens. Sent in lm-eval's order (question by question, its choices in turn) with
`num_concurrent` 1 (lm-eval's default) and 8 requests in flight.

Servers, all up at once, each run in turn in every round (interleaved: the host drifts):
1. stallfree as serve_config.yaml ships it, a cache_salt per run (nothing an earlier run left);
2. the same server with a cache_salt per request: nothing shared, every prompt computed whole
   (the work vLLM does, and stallfree did before);
3. vLLM 0.32's CPU backend (bench.peers) with its prefix caching on (`--enable-prefix-caching`,
   its users' default); skipped with a note where not installed.
Figures: requests/s per run, median over the rounds, and each round's ratios; per question the
choice with the highest logprob, which stallfree's two modes must agree on (the cache changes no
answer), with their largest difference in a choice's logprob.
Writes bench/results/eval_scoring.json. About 10 minutes (2 of them vLLM's start)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench import peers
from bench.driver import BenchmarkRun, print_verdicts
from bench.serving.cpu_serving import shipped_tokenizer
from bench.text_prompts import text_prompts
from harness import serve_cluster
from harness.sse_client import client_session

SUBJECTS, QUESTIONS, SHOTS = 2, 12, 5
CHOICES = (" A", " B", " C", " D")
CONCURRENCY = (1, 8)
PAYLOAD = {"temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}  # lm-eval's
OURS, UNSHARED = "stallfree", "stallfree, nothing shared"
VLLM_CACHED = peers.with_flags(peers.peer("vLLM CPU"), "vLLM CPU", "--enable-prefix-caching")
GOALS = {
    "requests_per_s_vs_unshared_min": 3.0,  # at every concurrency, the median of the rounds
    "requests_per_s_vs_vllm_min": 2.0,
    "same_choices_with_and_without_sharing": True,
}
TIMEOUT_S = 600


@dataclass(frozen=True)
class Scored:
    """One choice of one question: the token ids sent and where the choice starts in them."""

    question: int
    prompt: list[int]
    context_len: int


def workload(tokenizer, seed: int = 0) -> list[Scored]:
    """lm-eval's requests for MMLU's shape: each subject's header, each question, each choice."""

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def example(window: list[int], answer: str | None) -> list[int]:
        options = "".join(f"\n{letter}. option {letter.lower()}" for letter in "ABCD")
        return window + ids(f"{options}\nAnswer:") + (ids(f" {answer}\n\n") if answer else [])

    windows = iter(text_prompts(tokenizer, [80] * SUBJECTS * (SHOTS + QUESTIONS), seed))
    requests = []
    for subject in range(SUBJECTS):
        header = ids(
            f"The following are multiple choice questions (with answers) about subject {subject}.\n\n"
        )
        for _ in range(SHOTS):
            header += example(next(windows), "ABCD"[len(header) % 4])
        for question in range(QUESTIONS):
            context = header + example(next(windows), None)
            for choice in CHOICES:
                requests.append(Scored(subject * QUESTIONS + question, context + ids(choice), len(context)))
    return requests


@dataclass(frozen=True)
class Server:
    name: str
    url: str  # .../v1/completions
    model: str
    salt: Callable[[str], str | None]  # a request's cache_salt, given its run's: that, its own, or none


async def _score(http: aiohttp.ClientSession, server: Server, request: Scored, salt: str | None) -> float:
    body = {"model": server.model, "prompt": request.prompt, **PAYLOAD}
    if salt is not None:
        body["cache_salt"] = salt
    async with http.post(server.url, json=body) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status}: {answer}")
    # as lm-eval reads it: the echoed prompt's logprobs from the context's end, before the sampled one
    token_logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
    return sum(token_logprobs[request.context_len : len(request.prompt)])


async def _run(server: Server, requests: list[Scored], concurrency: int) -> dict:
    """Every request, `concurrency` in flight in lm-eval's order: requests/s and each one's logprob."""
    run_salt = f"run-{uuid.uuid4().hex}"
    queue = list(enumerate(requests))
    logprobs = [0.0] * len(requests)

    async def worker(http: aiohttp.ClientSession) -> None:
        while queue:
            index, request = queue.pop(0)
            logprobs[index] = await _score(http, server, request, server.salt(run_salt))

    started = time.monotonic()
    async with client_session(TIMEOUT_S, connections=concurrency) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    wall_s = time.monotonic() - started
    return {"requests_per_s": len(requests) / wall_s, "wall_s": wall_s, "logprobs": logprobs}


def choices(requests: list[Scored], logprobs: list[float]) -> list[int]:
    """Per question, the index of the choice with the highest logprob."""
    by_question: dict[int, list[float]] = {}
    for request, logprob in zip(requests, logprobs, strict=True):
        by_question.setdefault(request.question, []).append(logprob)
    return [max(range(len(scores)), key=scores.__getitem__) for scores in by_question.values()]


def _ratios(ours: list[dict], theirs: list[dict]) -> tuple[float, list[float]]:
    """Round by round ours / theirs requests/s, and their median."""
    by_round = [a["requests_per_s"] / b["requests_per_s"] for a, b in zip(ours, theirs, strict=True)]
    return statistics.median(by_round), by_round


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM CPU even where installed")
    parser.add_argument("--output", type=Path, default=Path("bench/results/eval_scoring.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("eval_scoring", args.output, GOALS)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-eval-scoring-"))
    print(f"logs in {work_dir}", flush=True)
    requests = workload(shipped_tokenizer())
    with_vllm = not args.no_vllm and VLLM_CACHED.installed
    if not with_vllm:
        print(f"{VLLM_CACHED.name}: skipped ({'--no-vllm' if args.no_vllm else 'not installed'})", flush=True)
    with ExitStack() as stack:
        if with_vllm:  # first, alone on the cores while it compiles
            stack.enter_context(peers.serving(VLLM_CACHED, work_dir / "vllm_cpu.log"))
        cluster = serve_cluster.start(
            serve_cluster.SHIPPED_CONFIG, work_dir, cluster_env=serve_cluster.BENCH_CLUSTER_ENV
        )
        stack.callback(serve_cluster.stop, cluster)
        cluster.wait_ready()
        ours_url = f"{cluster.base_url}/v1/completions"
        servers = [
            Server(OURS, ours_url, "smollm2-135m-instruct", lambda run: run),
            Server(UNSHARED, ours_url, "smollm2-135m-instruct", lambda run: uuid.uuid4().hex),
        ]
        if with_vllm:
            servers.append(Server(VLLM_CACHED.name, VLLM_CACHED.url, "vllm-cpu", lambda run: None))
        asyncio.run(_run(servers[0], requests[:8], 1))  # warm-up: first requests pay one-time costs
        runs: dict[tuple[str, int], list[dict]] = {}
        for round_index in range(args.rounds):
            for concurrency in CONCURRENCY:
                for server in servers:
                    result = asyncio.run(_run(server, requests, concurrency))
                    runs.setdefault((server.name, concurrency), []).append(result)
                    print(
                        f"round {round_index + 1} c={concurrency} {server.name}: "
                        f"{result['requests_per_s']:.2f} requests/s",
                        flush=True,
                    )
    body, met = judged(requests, runs, [s.name for s in servers])
    body["settings"] = {
        "subjects": SUBJECTS, "questions_per_subject": QUESTIONS, "shots": SHOTS, "choices": CHOICES,
        "requests": len(requests), "mean_prompt_tokens": statistics.mean(len(r.prompt) for r in requests),
        "payload": PAYLOAD, "concurrency": CONCURRENCY, "rounds": args.rounds,
        "vllm_command": VLLM_CACHED.command if with_vllm else "skipped: not installed or --no-vllm",
    }  # fmt: skip
    print_verdicts(met)
    run.write(body, met)


def judged(
    requests: list[Scored], runs: dict[tuple[str, int], list[dict]], names: list[str]
) -> tuple[dict, dict[str, bool]]:
    """Requests/s per server (median of the rounds), stallfree's ratios per concurrency (median
    of each round's), whether sharing changed a choice, and the goals' verdicts."""
    servers = {
        name: {f"c={c}": statistics.median(r["requests_per_s"] for r in runs[(name, c)]) for c in CONCURRENCY}
        for name in names
    }
    comparisons: dict[str, dict] = {}
    met = {key: True for key in GOALS}
    for c in CONCURRENCY:
        ours = runs[(OURS, c)]
        shared, unshared = ours[-1]["logprobs"], runs[(UNSHARED, c)][-1]["logprobs"]
        same = choices(requests, shared) == choices(requests, unshared)
        compared = {
            "same_choices": same,
            "max_logprob_difference": max(abs(a - b) for a, b in zip(shared, unshared, strict=True)),
        }
        for key, name in (("unshared", UNSHARED), ("vllm", VLLM_CACHED.name)):
            if name in names:
                median, by_round = _ratios(ours, runs[(name, c)])
                compared |= {f"vs_{key}": median, f"vs_{key}_rounds": by_round}
                met[f"requests_per_s_vs_{key}_min"] &= median >= GOALS[f"requests_per_s_vs_{key}_min"]
                rounds = ", ".join(f"{r:.2f}" for r in by_round)
                print(f"c={c}: {OURS} / {name}: {median:.2f}x (rounds {rounds})")
        met["same_choices_with_and_without_sharing"] &= same
        comparisons[f"c={c}"] = compared
    for name, figures in servers.items():
        print(f"{name:<28}" + "".join(f"  {c}: {rps:6.2f} requests/s" for c, rps in figures.items()))
    if VLLM_CACHED.name not in names:
        met.pop("requests_per_s_vs_vllm_min")  # not measured: no verdict
    return {"servers": servers, "comparisons": comparisons}, met


if __name__ == "__main__":
    main()
