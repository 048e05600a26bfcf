"""bench.gpu's served part: the same requests through Ray Serve (serve_config.gpu.yaml, one
replica, streamed /v1/completions over HTTP) and through the engine alone (an AsyncEngine in this
process, built as that replica builds its own), on the same device in the same run: closed loops
(c=1 and c=64 on a GPU) and Poisson arrivals at three rates, three seeds each. Each run: TTFT and
TBT p50/p99, output tok/s and failed requests (a closed loop's also where the host's cores went,
by process); then the served figures against the engine alone's.
The two cannot hold the device at once (each sizes its KV pool from the memory it finds free), so
they run in turn: the engine alone first, then the served app."""

from __future__ import annotations

import random
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from bench.driver import Arrival, EngineClient, Spread, engine_as_served, engine_sender
from bench.http_load import Send, Sender, http_sender, run_paced
from common.latency import RequestTiming, summarize
from harness import serve_cluster
from harness.pacing import closed_loop, open_loop
from harness.random_workload import poisson_times

GOALS = {
    "served_high_concurrency_tok_per_s_vs_engine_alone_min": 0.95,
    "served_c1_ttft_p50_over_engine_alone_max_s": 0.010,
    "served_c1_tbt_p50_vs_engine_alone_max": 1.1,
    "failed_requests_max": 0,
}


@dataclass(frozen=True)
class ServedPlan:
    closed: tuple[tuple[int, int], ...]  # (concurrency, requests) per closed-loop run, c=1 first
    poisson_rates: tuple[float, ...]  # requests per second
    poisson_requests: int
    seeds: tuple[int, ...]
    # bench.gpu's served_options part: (name, app args changed), each served on its own cluster
    # (closed loops only); none in the dry run, where each cluster would add a minute to make test
    options: tuple[tuple[str, dict], ...] = ()
    # the served part's interleaved rounds (alone, served, alone, served, ...): each round's ratios
    # and their median; one on a GPU, whose device call has room for one
    rounds: int = 1


def measure(sender: Sender, arrivals: list[Arrival], plan: ServedPlan) -> dict:
    """Every run of the plan through one system; each run with its own cache salt (nothing an
    earlier run left in the prefix cache is found). A request that fails is counted, not raised."""

    def run(paced: Callable[[Send], Awaitable[tuple[float, list[RequestTiming | None]]]]) -> dict:
        return _summary(*run_paced(sender, lambda send: paced(partial(_counted, send))))

    from bench.serving.cpu_split import cpu_split  # psutil: Ray's own copy, once ray is imported

    run(partial(closed_loop, items=arrivals[:4], concurrency=4))  # warm: kernels, first steps
    runs: dict[str, dict] = {}
    for concurrency, count in plan.closed:
        with cpu_split() as cores:  # where the host's cores went: which process took them
            figures = run(partial(closed_loop, items=arrivals[:count], concurrency=concurrency))
        runs[f"c{concurrency}"] = {**figures, "cpu": cores}
    for rate in plan.poisson_rates:
        seeds = [
            run(partial(open_loop, items=poisson(arrivals[: plan.poisson_requests], rate, seed)))
            for seed in plan.seeds
        ]
        figures = [s for s in seeds if "output_tok_per_s" in s]
        runs[f"poisson_{rate:g}"] = {
            "median": {key: Spread.of_runs(figures, key).median for key in figures[0]} if figures else {},
            "spread": {key: asdict(Spread.of_runs(figures, key)) for key in figures[0]} if figures else {},
            "failed": sum(s["failed"] for s in seeds),
            "runs": seeds,
        }
    return runs


async def _counted(send: Send, arrival: Arrival) -> RequestTiming | None:
    try:
        return await send(arrival)
    except Exception:  # a failed request: the run goes on, and its count says so
        return None


def _summary(wall_s: float, results: list[RequestTiming | None]) -> dict:
    timings = [t for t in results if t is not None]
    failed = {"requests": len(results), "failed": len(results) - len(timings)}
    return {**summarize(wall_s, timings), **failed} if timings else failed


def poisson(arrivals: list[Arrival], rate: float, seed: int) -> list[Arrival]:
    times = poisson_times(random.Random(seed), len(arrivals), rate)
    return [Arrival(t, a.prompt, a.max_tokens) for a, t in zip(arrivals, times, strict=True)]


def engine_alone(app_args: dict, base: Path, arrivals: list[Arrival], plan: ServedPlan) -> dict:
    """The plan's runs straight into an AsyncEngine built as the served replica's is."""
    engine = engine_as_served(app_args.get("engine"), app_args=app_args, base=base)
    try:
        return measure(engine_sender(EngineClient(engine)), arrivals, plan)
    finally:
        engine.shutdown()


def through_serve(
    app_args: dict, base: Path, work_dir: Path, arrivals: list[Arrival], plan: ServedPlan
) -> dict:
    """The plan's runs over HTTP into the app, one replica, on a one-node Ray cluster (Ray's own
    report intervals, as a user's cluster runs)."""
    config = serve_cluster.config_with_apps(work_dir / "served.yaml", {"gpu": app_args}, base=base)
    cluster = serve_cluster.start(config, work_dir, cluster_env=serve_cluster.BENCH_CLUSTER_ENV)
    try:
        cluster.wait_ready("/gpu")
        return measure(http_sender(f"{cluster.base_url}/gpu/v1/completions"), arrivals, plan)
    finally:
        serve_cluster.stop(cluster)


def comparison(alone: dict, served: dict, plan: ServedPlan) -> dict[str, float | None]:
    """The served figures against the engine alone's (closed loops; Poisson medians); None where
    a run has no figure (every request of it failed)."""
    low, high = (f"c{concurrency}" for concurrency, _ in (plan.closed[0], plan.closed[-1]))

    def figure(runs: dict, name: str, key: str) -> float | None:
        return runs[name].get("median", runs[name]).get(key)

    def ratio(name: str, key: str) -> float | None:
        ours, theirs = figure(served, name, key), figure(alone, name, key)
        return None if ours is None or not theirs else ours / theirs

    ttft = figure(served, low, "ttft_p50_s"), figure(alone, low, "ttft_p50_s")
    return {
        "high_concurrency": plan.closed[-1][0],
        "high_concurrency_tok_per_s_ratio": ratio(high, "output_tok_per_s"),
        "c1_ttft_p50_extra_s": None if None in ttft else ttft[0] - ttft[1],  # type: ignore[operator]
        "c1_tbt_p50_ratio": ratio(low, "tbt_p50_s"),
        **{
            f"{name}_tok_per_s_ratio": ratio(name, "output_tok_per_s")
            for name in served
            if name.startswith("poisson_")
        },
        "failed_requests": sum(run["failed"] for runs in (alone, served) for run in runs.values()),
    }


def median_comparison(rounds: list[dict]) -> dict[str, float | None]:
    """Interleaved rounds' comparisons as one: each figure's median over the rounds (None where a
    round has none), the failed requests of every round."""

    def median(key: str) -> float | None:
        values = [figures[key] for figures in rounds]
        return None if None in values else statistics.median(values)

    return {
        key: sum(figures[key] for figures in rounds) if key == "failed_requests" else median(key)
        for key in rounds[0]
    }


def goals_met(figures: dict[str, float] | None) -> dict[str, bool]:
    """Each goal against `comparison`'s figures; every one missed where the part did not run."""
    ratio = GOALS["served_high_concurrency_tok_per_s_vs_engine_alone_min"]
    extra_s = GOALS["served_c1_ttft_p50_over_engine_alone_max_s"]
    tbt = GOALS["served_c1_tbt_p50_vs_engine_alone_max"]
    judged = {
        f"served at the highest concurrency: output tok/s >= {ratio}x the engine alone's": (
            "high_concurrency_tok_per_s_ratio",
            lambda value: value >= ratio,
        ),
        f"served c=1 TTFT p50 <= the engine alone's + {extra_s * 1000:g} ms": (
            "c1_ttft_p50_extra_s",
            lambda value: value <= extra_s,
        ),
        f"served c=1 TBT p50 <= {tbt}x the engine alone's": ("c1_tbt_p50_ratio", lambda value: value <= tbt),
        "no request failed, served or alone": ("failed_requests", lambda value: value == 0),
    }
    return {
        goal: figures is not None and figures[key] is not None and bool(judge(figures[key]))
        for goal, (key, judge) in judged.items()
    }
