"""Servers measured side by side in interleaved rounds (A B C, A B C, ...): each round holds every
server's closed-loop runs and one Poisson seed; the host's speed drifts within an hour, so a
comparison is a ratio taken within a round (paired), then its median over the rounds. Rounds
whose ratios disagree by more than DISAGREE are named: the run could not tell a host that sped up
from a server that did."""

from __future__ import annotations

import statistics
from dataclasses import asdict

from bench.driver import Spread

DISAGREE = 0.15  # (max - min) / median of a paired ratio over the rounds
RUNS = ("c1", "c16", "poisson")  # a round's runs, each a latency summary
HIGHER_IS_BETTER = ("output_tok_per_s",)
FIGURES = ("output_tok_per_s", "ttft_p50_s", "tbt_p50_s", "tbt_p99_s")


def figures(result: dict) -> dict[str, float]:
    """A server's figures under the names of bench.peers' quoted table (plus Poisson, measured),
    from a combined result or from one round's."""
    if "quoted" in result:
        return result["quoted"]
    poisson = result["poisson"].get("median", result["poisson"])
    runs = {"c1": result["c1"], "c16": result["c16"], "poisson": poisson}
    return {
        f"{run}_{key}": summary[key] for run, summary in runs.items() for key in FIGURES if key in summary
    }


def combine(rounds: list[dict]) -> dict:
    """One server's rounds as one result: each closed-loop figure the median over the rounds, and
    Poisson over the rounds' seeds (median, spread and each seed's run), the rounds kept."""
    combined: dict = {"rounds": rounds}
    for run in ("c1", "c16"):
        summaries = [r[run] for r in rounds]
        combined[run] = {key: statistics.median(s[key] for s in summaries) for key in summaries[0]}
    seeds = [r["poisson"] for r in rounds]
    spread = {key: Spread.of_runs(seeds, key) for key in seeds[0]}
    combined["poisson"] = {
        "median": {key: s.median for key, s in spread.items()},
        "spread": {key: asdict(s) for key, s in spread.items()},
        "runs": seeds,
    }
    return combined


def ratios_by_round(ours: list[dict], theirs: list[dict]) -> dict[str, list[float]]:
    """Ours over theirs, figure by figure, each round's runs against the same round's."""
    paired = [(figures(a), figures(b)) for a, b in zip(ours, theirs, strict=True)]
    common = set.intersection(*(set(a) & set(b) for a, b in paired))
    return {
        key: [a[key] / b[key] for a, b in paired] for key in sorted(common) if all(b[key] for _, b in paired)
    }


def median_ratios(by_round: dict[str, list[float]]) -> dict[str, float]:
    return {key: statistics.median(values) for key, values in by_round.items()}


def disagreement(by_round: dict[str, list[float]]) -> dict[str, float]:
    """The figures whose ratio moved by more than DISAGREE between rounds: (max - min) / median."""
    spread = {key: (max(v) - min(v)) / statistics.median(v) for key, v in by_round.items() if len(v) > 1}
    return {key: value for key, value in spread.items() if value > DISAGREE}


def ahead_on_every_figure(by_figure: dict[str, float]) -> bool:
    """Ours over theirs: higher throughput, lower latencies, on every figure both have."""
    return bool(by_figure) and all(
        ratio > 1 if key.endswith(HIGHER_IS_BETTER) else ratio < 1 for key, ratio in by_figure.items()
    )
