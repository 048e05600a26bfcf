"""The driver every benchmark runs on: workload records, an in-process engine as the app builds
it with a client that times each request (paced by harness.pacing's open and closed loops, as
the HTTP loads are), one figure's median and spread over seeds, and result files that always say
what they were judged by: summaries a person can read, per-request records beside them, gzipped."""

from __future__ import annotations

import datetime
import gzip
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

from bench import catalog
from common.latency import RequestTiming
from harness.random_workload import random_tokens
from harness.serve_cluster import SHIPPED_CONFIG, shipped_app_config, with_app_args

if TYPE_CHECKING:
    from replica_engine import AsyncEngine, SamplingParams
    from replica_engine.metrics import EngineMetrics


@dataclass(frozen=True)
class Arrival:
    at_s: float  # from the run's start (at rate r, at_s / r); closed loops ignore it
    prompt: list[int] | str  # token ids, or text (the server tokenizes it)
    max_tokens: int  # exact: greedy with ignore_eos, so every system does the same work


@dataclass(frozen=True)
class Workload:
    """Every request at once (an offline batch)."""

    prompts: list[list[int]]  # token ids
    output_lens: list[int]


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
        prompts=[random_tokens(rng, n, token_range) for n in prompt_lens],
        output_lens=[rng.randint(*output_range) for _ in range(num_requests)],
    )


def greedy(max_tokens: int, **settings: object) -> SamplingParams:
    """Exactly `max_tokens` greedy tokens: the same work for every system under comparison."""
    from replica_engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **settings)


def engine_as_served(
    engine_settings: dict | None = None,
    metrics: EngineMetrics | None = None,
    num_threads: int | None = None,
    *,
    app_args: dict | None = None,
    base: Path = SHIPPED_CONFIG,
) -> AsyncEngine:
    """An AsyncEngine in this process, built as a shipped config's app builds its replica's
    (serve_config.yaml, or `base`; `app_args` and `engine_settings` over its own; torch's threads:
    `num_threads`, else as the replica's): the engine without Ray."""
    import torch

    from deployments.app_args import AppArgs
    from replica_engine import AsyncEngine

    shipped = shipped_app_config(base)["applications"][0]["args"]
    settings = with_app_args(shipped, {**(app_args or {}), "engine": engine_settings or {}})
    args = AppArgs.model_validate(settings)
    # the replica's: its cpu_threads, else a GPU replica keeps the OMP_NUM_THREADS Ray gives an
    # actor (its num_cpus, at least 1) and a CPU replica takes every core
    gpu_threads = max(1, math.floor(args.num_cpus)) if args.num_gpus else None
    threads = num_threads or args.cpu_threads or gpu_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    return AsyncEngine(args.engine_config(), metrics)


@dataclass
class Served:
    """One request as the in-process engine's client saw it."""

    timing: RequestTiming
    output: list[int]  # token ids
    cached_tokens: int  # of the prompt, found in the prefix cache


class EngineClient:
    """Requests straight into an AsyncEngine in this process, each timed token by token."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def send(self, prompt: list[int], params: SamplingParams) -> Served:
        sent = time.monotonic()
        token_times: list[float] = []
        output: list[int] = []
        cached = 0
        async for out in await self.engine.add_request(prompt, params):
            if out.new_token_ids:
                token_times.append(time.monotonic())
            output += out.new_token_ids
            cached = out.num_cached_tokens
        gaps = [b - a for a, b in pairwise(token_times)]
        timing = RequestTiming(len(prompt), len(output), token_times[0] - sent, time.monotonic() - sent, gaps)
        return Served(timing, output, cached)


def engine_sender(client: EngineClient):
    """bench.http_load's Sender for an engine in this process: greedy, exact lengths, the salt."""

    @asynccontextmanager
    async def sender(salt: str) -> AsyncIterator[Callable[[Arrival], Awaitable[RequestTiming]]]:
        async def send(arrival: Arrival) -> RequestTiming:
            assert isinstance(arrival.prompt, list)  # token ids: no tokenizer in between
            return (await client.send(arrival.prompt, greedy(arrival.max_tokens, cache_salt=salt))).timing

        yield send

    return sender


@dataclass(frozen=True)
class Spread:
    """One figure over seeds (or over paired runs): its median and the range it spans."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        values = list(values)
        return cls(statistics.median(values), min(values), max(values))

    @classmethod
    def of_runs(cls, runs: list[dict], key: str) -> Spread:
        return cls.of(run[key] for run in runs)

    @classmethod
    def of_ratios(cls, ours: list[dict], theirs: list[dict], key: str) -> Spread:
        """Run by run ours / theirs (paired: the same arrivals, or back-to-back runs), then over
        the pairs: pairing cancels most of the host's drift between runs."""
        return cls.of(a[key] / b[key] for a, b in zip(ours, theirs, strict=True))

    @property
    def range(self) -> list[float]:
        return [self.min, self.max]

    def __format__(self, spec: str) -> str:
        """`median [min-max]`, each number formatted by `spec`."""
        return f"{self.median:{spec}} [{self.min:{spec}}-{self.max:{spec}}]"


def _command(benchmark: str) -> str:
    """How to rerun it: with this run's arguments when it was run as `python -m bench <name>`."""
    command = catalog.command(benchmark)
    known = catalog.benchmarks().get(benchmark)
    if known is not None and Path(sys.argv[0]).resolve() == known.path:
        return shlex.join([*command.split(), *sys.argv[1:]])
    return command


def result_header(benchmark: str) -> dict[str, object]:
    """What every result file starts with: which benchmark, how to rerun it, when, and where."""
    import torch

    return {
        "benchmark": benchmark,
        "command": _command(benchmark),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            **cpu_model(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
    }


# The instruction sets a CPU peer's kernels pick by (oneDNN's bf16 GEMMs run on AMX where present).
_CPU_FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_model() -> dict[str, object]:
    """Which CPU (the host's model can change between days): its name and the flags that matter."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name", ""), "cpu_flags": [f for f in _CPU_FLAGS if f in flags]}


def write_result(path: Path, result: dict, raw: dict | None = None) -> None:
    """A result file; every one says what it was judged by and how long it took. It holds
    summaries only, floats to 7 significant digits: per-request records (what a plot draws) go
    to `raw_path(path)`."""
    missing = {"goals", "goals_met", "run_s"} - result.keys()
    if missing:
        raise ValueError(f"a result needs {sorted(missing)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # default: settings may hold Paths
    path.write_text(json.dumps(_rounded(result, _significant), indent=2, default=str))
    print(f"wrote {path} ({result['run_s']} s)")
    if raw is not None:
        write_raw(path, raw)


def raw_path(result_path: Path) -> Path:
    return result_path.with_name(f"{result_path.stem}.raw.json.gz")


def write_raw(result_path: Path, raw: dict) -> None:
    """Per-request records beside a result, rounded to the microsecond (finer than a client's
    timings mean) and gzipped: about a tenth of them as plain JSON, which git carries per rerun."""
    path = raw_path(result_path)
    data = json.dumps(_rounded(raw, _microseconds), separators=(",", ":")).encode()
    with gzip.GzipFile(path, "wb", mtime=0) as file:  # no timestamp: the same records, the same bytes
        file.write(data)
    print(f"wrote {path}")


def _significant(value: float) -> float:
    """7 significant digits: a figure's 17 are noise, and they make a summary of hundreds of runs
    twice the size (small coefficients keep theirs)."""
    return float(f"{value:.7g}")


def _microseconds(value: float) -> float:
    return round(value, 6)


def _rounded(value: object, rounding: Callable[[float], float]) -> object:
    """Every float in nested dicts and lists (tuples become lists, as in JSON) rounded."""
    if isinstance(value, float):
        return rounding(value)
    if isinstance(value, dict):
        return {key: _rounded(v, rounding) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v, rounding) for v in value]
    return value


@dataclass
class BenchmarkRun:
    """One run of a benchmark: where its result goes, what it is judged by, when it started."""

    benchmark: str
    output: Path
    goals: dict
    started: float = field(default_factory=time.monotonic)

    def write(self, body: dict, goals_met: dict[str, bool], raw: dict | None = None) -> None:
        """The result so far or in full (goals_met empty: not judged); raw: per-request records."""
        run_s = round(time.monotonic() - self.started, 1)
        result = {**result_header(self.benchmark), **body, "goals": self.goals, "goals_met": goals_met}
        write_result(self.output, {**result, "run_s": run_s}, raw)


def print_verdicts(goals_met: dict[str, bool]) -> None:
    for goal, met in goals_met.items():
        print(f"{goal}: {'PASS' if met else 'MISS'}")


def pyplot():
    """matplotlib's pyplot, drawing to files only (a benchmark host has no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
