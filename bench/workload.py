"""Synthetic offline workloads and the latency records every benchmark shares."""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids
    output_lens: list[int]


@dataclass(frozen=True)
class RequestTiming:
    prompt_len: int
    output_len: int
    ttft_s: float  # from the run's start (all requests arrive at once)
    e2e_s: float


def uniform_workload(
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    token_range: tuple[int, int],
    seed: int,
) -> Workload:
    """Prompt and output lengths uniform in their ranges; prompt tokens uniform in token_range."""
    rng = random.Random(seed)
    prompt_lens = [rng.randint(*prompt_range) for _ in range(num_requests)]
    return Workload(
        prompts=[[rng.randrange(*token_range) for _ in range(n)] for n in prompt_lens],
        output_lens=[rng.randint(*output_range) for _ in range(num_requests)],
    )


RANDOM_TOKEN_RANGE = (1000, 40000)  # random prompt ids from the ordinary vocabulary


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*RANDOM_TOKEN_RANGE) for _ in range(n)]


def write_result(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} ({result['run_s']} s)")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def result_header(benchmark: str) -> dict[str, object]:
    """What every result file starts with: which benchmark, how to rerun it, when, and where."""
    import torch

    return {
        "benchmark": benchmark,
        "command": f"python -m bench.{benchmark}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
    }


def summarize(wall_s: float, timings: list[RequestTiming]) -> dict[str, float]:
    ttft = [t.ttft_s for t in timings]
    e2e = [t.e2e_s for t in timings]
    return {
        "wall_s": wall_s,
        "output_tokens": sum(t.output_len for t in timings),
        "output_tok_per_s": sum(t.output_len for t in timings) / wall_s,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "e2e_mean_s": statistics.fmean(e2e),
        "e2e_p50_s": percentile(e2e, 0.5),
        "e2e_p99_s": percentile(e2e, 0.99),
    }


def records(timings: list[RequestTiming]) -> list[dict[str, float]]:
    return [asdict(t) for t in timings]
