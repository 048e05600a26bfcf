"""The soak load (bench.serving.soak and tests/serve/test_load.py): streamed random-token requests at a
fixed concurrency, some clients hanging up mid-stream, each request's outcome judged against its
exact length (and, where known, its greedy output), and the client-side report."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from common.latency import percentile
from harness.pacing import closed_loop
from harness.random_workload import log_uniform, random_tokens
from harness.sse_client import StreamResult, client_session, stream_completion


@dataclass(frozen=True)
class SoakRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    disconnect_after_chunks: int | None = None  # the client hangs up after this many chunks
    expected_token_ids: list[int] | None = None  # greedy output computed offline, where known


def with_expected_outputs(requests: list[SoakRequest], model: str) -> list[SoakRequest]:
    """The same requests, each knowing its greedy output from the offline engine in float32 (every
    request is greedy; in fp32 our CPU engine's rows do not depend on their batch mates, so the
    server must run float32 too)."""
    from replica_engine import LLM, SamplingParams

    outputs = LLM(model, dtype="float32").generate(
        [r.prompt_token_ids for r in requests],
        [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests],
    )
    return [
        dataclasses.replace(request, expected_token_ids=output.outputs[0].token_ids)
        for request, output in zip(requests, outputs, strict=True)
    ]


def soak_workload(
    num_requests: int,
    vocab_size: int,
    disconnect_fraction: float,
    seed: int,
    prompt_range: tuple[int, int] = (8, 512),
    output_range: tuple[int, int] = (1, 128),
) -> list[SoakRequest]:
    """Prompts log-uniform in `prompt_range` of any token id, outputs uniform in `output_range`."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = log_uniform(rng, *prompt_range)
        max_tokens = rng.randint(*output_range)
        hangs_up = max_tokens > 1 and rng.random() < disconnect_fraction
        requests.append(
            SoakRequest(
                random_tokens(rng, prompt_len, (0, vocab_size)),
                max_tokens,
                rng.randint(1, max_tokens - 1) if hangs_up else None,
            )
        )
    return requests


def outcome(request: SoakRequest, result: StreamResult) -> str:
    """completed, disconnected, failed:<code>, or wrong_output: a count off, or (where the
    expected output is known) a token that differs, even before a hang-up."""
    expected = request.expected_token_ids
    if expected is not None and result.token_ids != expected[: len(result.token_ids)]:
        return "wrong_output"
    if result.disconnected:
        return "disconnected"
    if result.status != 200 or result.error_code is not None:
        return f"failed:{result.error_code}"
    counted = result.completion_tokens == request.max_tokens and result.finish_reason == "length"
    if counted and (expected is None or result.token_ids == expected):
        return "completed"
    return "wrong_output"


async def run_load(
    url: str,
    requests: list[SoakRequest],
    concurrency: int,
    on_finished: Callable[[int], None] | None = None,
) -> tuple[float, list[StreamResult]]:
    """Send every request, at most `concurrency` at once; `on_finished(count)` after each ends."""
    num_finished = 0

    async def one(http: aiohttp.ClientSession, request: SoakRequest) -> StreamResult:
        nonlocal num_finished
        body = {
            "prompt": request.prompt_token_ids,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        try:
            result = await stream_completion(http, url, body, request.disconnect_after_chunks)
        except (aiohttp.ClientError, TimeoutError) as error:  # counted, not raised: the report says so
            result = StreamResult(status=0, error_code=f"client:{type(error).__name__}")
        num_finished += 1
        if on_finished is not None:
            on_finished(num_finished)
        return result

    async with client_session(600, connections=concurrency) as http:
        return await closed_loop(lambda request: one(http, request), requests, concurrency)


def client_report(requests: list[SoakRequest], results: list[StreamResult], wall_s: float) -> dict:
    outcomes = Counter(outcome(r, res) for r, res in zip(requests, results, strict=True))
    completed = [res for r, res in zip(requests, results, strict=True) if outcome(r, res) == "completed"]
    ttft = [res.ttft_s for res in completed]
    gaps = [gap for res in completed for gap in res.chunk_gaps_s]
    return {
        "requests_sent": len(requests),
        "disconnects_planned": sum(r.disconnect_after_chunks is not None for r in requests),
        "outcomes": dict(sorted(outcomes.items())),
        "wall_s": round(wall_s, 2),
        "output_tokens_completed": sum(res.completion_tokens for res in completed),
        "ttft_p50_s": percentile(ttft, 0.5) if ttft else None,
        "ttft_p99_s": percentile(ttft, 0.99) if ttft else None,
        "tbt_p99_s": percentile(gaps, 0.99) if gaps else None,  # between chunks of one stream
    }
