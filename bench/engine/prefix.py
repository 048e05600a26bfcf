"""`python -m bench prefix`: prefix caching on vs off, on the real SmolLM2 in one process
(AsyncEngine as serve_config.yaml builds it, no Ray: the engine is what is measured).

Workloads (random token ids; greedy, ignore_eos, exact output lengths):
- shared_prefix: SGLang's generated-shared-prefix shape, G=4 groups x P=8 prompts, a 512-token
  system prompt per group + a 32-token question, 32 output tokens.
- multi_turn: 8 conversations of 4-8 turns (a 128-token system prompt each; every turn a
  32-64-token user message and a 32-token answer, the next turn resending the whole history
  0.5 s after the answer).
- no_shared: 32 prompts of 64-512 tokens (log-uniform) with nothing in common, 32 output tokens:
  what caching costs when it cannot help (hashing every block).

TTFT: Poisson arrivals (shared_prefix 1 request/s, multi_turn 0.5 conversations/s), 3 arrival
seeds, median and spread. Throughput: every request at once (a burst; multi_turn: every
conversation at once), output tokens / makespan; no_shared's burst runs 5 times per system,
alternating on/off, and its ratio is the median of the 5 paired ratios (the host's drift between
runs is larger than the 3% asked; pairs cancel most of it). Its caching-on runs also time the
prefix cache's own work on the step thread (hashing, lookups, registering blocks) directly.
One engine serves every run, its prefix caching switched on or off between runs while idle; each
run has its own cache_salt, so no run finds another's blocks.
Writes bench/results/prefix_cpu.json and .png."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

from bench.driver import (
    Arrival,
    BenchmarkRun,
    EngineClient,
    Served,
    Spread,
    engine_as_served,
    greedy,
    print_verdicts,
    pyplot,
)
from common.latency import percentile
from harness.pacing import open_loop
from harness.random_workload import log_uniform, poisson_times, random_tokens

SEEDS = (0, 1, 2)
NO_SHARED_PAIRS = 5
OUTPUT_TOKENS = 32
GOALS = {
    "shared_prefix_ttft_p50_ratio_max": 0.3,
    "shared_prefix_throughput_ratio_min": 1.5,
    "no_shared_throughput_ratio_min": 0.97,
}


@dataclass
class Conversation:
    system: list[int]
    messages: list[list[int]]  # the user's, one per turn; each turn resends the whole history
    at_s: float  # from the run's start


def shared_prefix(seed: int, rate: float | None) -> list[Arrival]:
    rng = random.Random(seed)
    systems = [random_tokens(rng, 512) for _ in range(4)]
    prompts = [system + random_tokens(rng, 32) for system in systems for _ in range(8)]
    rng.shuffle(prompts)
    times = poisson_times(rng, len(prompts), rate)
    return [Arrival(t, p, OUTPUT_TOKENS) for p, t in zip(prompts, times, strict=True)]


def no_shared(seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    return [Arrival(0.0, random_tokens(rng, log_uniform(rng, 64, 512)), OUTPUT_TOKENS) for _ in range(32)]


def conversations(seed: int, rate: float | None) -> list[Conversation]:
    rng = random.Random(seed)
    return [
        Conversation(
            random_tokens(rng, 128),
            [random_tokens(rng, rng.randint(32, 64)) for _ in range(rng.randint(4, 8))],
            start,
        )
        for start in poisson_times(rng, 8, rate)
    ]


class Runner:
    def __init__(self) -> None:
        self.client = EngineClient(engine_as_served({"core_process": False}))  # its cache is switched here
        self.salt = 0

    def set_caching(self, enabled: bool) -> None:
        """Between runs, while the engine is idle: the step thread reads the flag only in a step."""
        self.client.engine.client.core.kv_cache_manager.enable_prefix_caching = enabled

    async def converse(self, chat: Conversation, salt: str) -> list[Served]:
        history, served = list(chat.system), []
        for index, message in enumerate(chat.messages):
            if index:
                await asyncio.sleep(0.5)  # the user reads, then writes the next message
            history += message
            served.append(await self.client.send(list(history), greedy(OUTPUT_TOKENS, cache_salt=salt)))
            history += served[-1].output
        return served

    def run(self, workload: list[Arrival] | list[Conversation], enabled: bool) -> dict:
        """Serve a workload (single turns, or conversations); its summary."""
        self.set_caching(enabled)
        self.salt += 1
        salt = f"run-{self.salt}"

        async def one(item: Arrival | Conversation) -> list[Served]:
            if isinstance(item, Conversation):
                return await self.converse(item, salt)
            return [await self.client.send(item.prompt, greedy(item.max_tokens, cache_salt=salt))]

        wall, results = asyncio.run(open_loop(one, workload))
        served = [s for result in results for s in result]
        ttft = [s.timing.ttft_s for s in served]
        prompt_tokens = sum(s.timing.prompt_len for s in served)
        return {
            "requests": len(served),
            "wall_s": wall,
            "output_tok_per_s": sum(len(s.output) for s in served) / wall,
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p99_s": percentile(ttft, 0.99),
            "hit_rate": sum(s.cached_tokens for s in served) / prompt_tokens,
            "prompt_tokens": prompt_tokens,
        }


SYSTEMS = {"caching on": True, "caching off": False}


def measure(runner: Runner) -> dict:
    results: dict = {"poisson": {}, "burst": {}}
    for workload, make, rate in (("shared_prefix", shared_prefix, 1.0), ("multi_turn", conversations, 0.5)):
        results["poisson"][workload] = {
            system: [runner.run(make(seed, rate), enabled) for seed in SEEDS]
            for system, enabled in SYSTEMS.items()
        }
        results["burst"][workload] = {system: [runner.run(make(0, None), e)] for system, e in SYSTEMS.items()}
        _progress(workload, results)
    results["burst"]["no_shared"] = {system: [] for system in SYSTEMS}
    for pair in range(NO_SHARED_PAIRS):
        for system, enabled in list(SYSTEMS.items())[:: 1 if pair % 2 == 0 else -1]:
            timer = BookkeepingTimer(runner.client.engine.client.core.kv_cache_manager) if enabled else None
            run = runner.run(no_shared(0), enabled)
            if timer is not None:
                run["prefix_cache_bookkeeping_s"] = timer.stop()
            results["burst"]["no_shared"][system].append(run)
    _progress("no_shared", results)
    return results


class BookkeepingTimer:
    """Wall time inside the KV manager's prefix-cache calls, on this instance only, until stop()."""

    METHODS = ("find_cached_blocks", "cache_computed_blocks", "block_hashes")

    def __init__(self, kv_cache: object) -> None:
        self.kv_cache, self.total_s, self.depth = kv_cache, 0.0, 0
        for name in self.METHODS:
            setattr(kv_cache, name, self._timed(getattr(kv_cache, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            self.depth += 1  # nested calls (lookups hash) count once
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.total_s += time.perf_counter() - started

        return timed

    def stop(self) -> float:
        for name in self.METHODS:
            delattr(self.kv_cache, name)  # the class's methods again
        return self.total_s


def _progress(workload: str, results: dict) -> None:
    for kind in ("poisson", "burst"):
        for system, runs in results[kind].get(workload, {}).items():
            print(kind, workload, system, [round(r["ttft_p50_s"], 3) for r in runs],
                  [round(r["output_tok_per_s"], 1) for r in runs], flush=True)  # fmt: skip


def _row(workload: str, system: str, poisson: list[dict], burst: list[dict]) -> dict:
    row = {"workload": workload, "system": system, "ttft_p50_s": None, "ttft_p50_spread_s": None}
    row["ttft_p99_s"] = None
    if poisson:
        p50 = Spread.of_runs(poisson, "ttft_p50_s")
        row.update(ttft_p50_s=p50.median, ttft_p50_spread_s=p50.range)
        row["ttft_p99_s"] = Spread.of_runs(poisson, "ttft_p99_s").median
    row["burst_output_tok_per_s"] = Spread.of_runs(burst, "output_tok_per_s").median
    row["hit_rate"] = Spread.of_runs(poisson or burst, "hit_rate").median
    return row


def summarize(results: dict) -> tuple[list[dict], dict[str, float]]:
    rows = [
        _row(workload, system, results["poisson"].get(workload, {}).get(system, []), burst)
        for workload, by_system in results["burst"].items()
        for system, burst in by_system.items()
    ]
    on = {row["workload"]: row for row in rows if row["system"] == "caching on"}
    off = {row["workload"]: row for row in rows if row["system"] == "caching off"}

    def ratio(workload: str, key: str) -> float:
        return on[workload][key] / off[workload][key]

    ratios = {
        "shared_prefix_ttft_p50_ratio": ratio("shared_prefix", "ttft_p50_s"),
        "shared_prefix_throughput_ratio": ratio("shared_prefix", "burst_output_tok_per_s"),
        "multi_turn_ttft_p50_ratio": ratio("multi_turn", "ttft_p50_s"),
        "no_shared_throughput_ratio": Spread.of_ratios(
            results["burst"]["no_shared"]["caching on"],
            results["burst"]["no_shared"]["caching off"],
            "output_tok_per_s",
        ).median,
    }
    return rows, ratios


def print_table(rows: list[dict], ratios: dict[str, float]) -> None:
    header = ("workload", 14), ("system", 12), ("TTFT p50 (spread)", 24), ("TTFT p99", 9)
    header += ("burst tok/s", 12), ("hit rate", 9)
    print(" ".join(f"{name:<{width}}" for name, width in header))
    for row in rows:
        p50, p99 = "-", "-"
        if row["ttft_p50_s"] is not None:
            low, high = row["ttft_p50_spread_s"]
            p50, p99 = f"{row['ttft_p50_s']:.3f} ({low:.3f}-{high:.3f})", f"{row['ttft_p99_s']:.3f}"
        print(f"{row['workload']:<14} {row['system']:<12} {p50:<24} {p99:<9} "
              f"{row['burst_output_tok_per_s']:<12.1f} {row['hit_rate']:<9.2f}")  # fmt: skip
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")


def goals_met(ratios: dict[str, float]) -> dict[str, bool]:
    return {
        "shared_prefix_ttft_p50_ratio_max": ratios["shared_prefix_ttft_p50_ratio"]
        <= GOALS["shared_prefix_ttft_p50_ratio_max"],
        "shared_prefix_throughput_ratio_min": ratios["shared_prefix_throughput_ratio"]
        >= GOALS["shared_prefix_throughput_ratio_min"],
        "no_shared_throughput_ratio_min": ratios["no_shared_throughput_ratio"]
        >= GOALS["no_shared_throughput_ratio_min"],
    }


def plot(path: Path, results: dict) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, workload in zip(axes, ("shared_prefix", "multi_turn"), strict=True):
        for system, runs in results["poisson"][workload].items():
            seeds = [r["ttft_p50_s"] for r in runs]
            axis.plot(list(SEEDS), seeds, marker="o", label=f"{system} p50")
            axis.plot(
                list(SEEDS), [r["ttft_p99_s"] for r in runs], marker="x", linestyle=":", label=f"{system} p99"
            )
        axis.set_yscale("log")
        axis.set_xlabel("arrival seed")
        axis.set_ylabel("TTFT (s)")
        axis.set_title(f"{workload}, Poisson arrivals")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("bench/results/prefix_cpu.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("prefix", args.output, GOALS)
    runner = Runner()
    try:
        runner.run(no_shared(99)[:4], True)  # warm: kernels, first steps
        results = measure(runner)
    finally:
        runner.client.engine.shutdown()
    rows, ratios = summarize(results)
    print_table(rows, ratios)
    on_runs = results["burst"]["no_shared"]["caching on"]
    bookkeeping = sum(r["prefix_cache_bookkeeping_s"] for r in on_runs) / sum(r["wall_s"] for r in on_runs)
    print(f"no_shared, caching on: prefix-cache bookkeeping {bookkeeping:.2%} of the run's wall time")
    met = goals_met(ratios)
    print_verdicts(met)
    run.write({
        "engine": {key: str(value) for key, value in vars(runner.client.engine.inputs.config).items()},
        "workloads": __doc__,
        "summary": rows,
        "ratios": ratios,
        "no_shared_prefix_cache_bookkeeping_share": bookkeeping,
        "runs": results,
    }, met)  # fmt: skip
    plot(args.output.with_suffix(".png"), results)


if __name__ == "__main__":
    main()
