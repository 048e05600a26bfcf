"""`python -m bench structured`: what structured outputs cost (issue 27). cpu_serving's workload
(32 requests, prompts of 16-1024 tokens of English text, outputs of 16-256 tokens, greedy,
ignore_eos, exact lengths) at 16 concurrent clients, straight into the engine a replica runs
(engine_as_served: no Ray, no HTTP), with 0%, 50% and 100% of requests constrained by a JSON
schema, and with 0% on the code as it was before this issue ("today", commit TODAY, checked out
in a git worktree). The schema asks for 64+ records, so a constrained request runs to its exact
length like the others, its grammar mask changing as it goes (structure, strings, numbers).

Each system runs in a worker process of its own that keeps its engine; runs alternate between
them round by round (order reversed every other round), and figures are ratios taken within a
round, then the median over rounds. Also reported: grammar compile time per schema, cold (a
fresh compiler) and cached, over this schema and harness/pydantic_schemas.py's twenty.
Writes bench/results/structured.json. ~15 minutes; not part of make test."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

TODAY = "4c2ec23"  # the last commit before issue 27
ROUNDS = 3
CONCURRENCY = 16
FRACTIONS = (0.0, 0.5, 1.0)
GOALS = {
    "unconstrained_tok_per_s_vs_today_min": 0.97,
    "unconstrained_tbt_p99_vs_today_max": 1.03,
    "all_constrained_tok_per_s_vs_unconstrained_min": 0.85,
}
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 64}},
    "required": ["records"],
    "additionalProperties": False,
}
REPO = Path(__file__).resolve().parents[2]


# -- the worker: one engine, runs on request ----------------------------------------------
def _run(client, arrivals, fraction: float) -> dict[str, float]:
    from bench.driver import greedy
    from common.latency import summarize
    from harness.pacing import closed_loop

    salt = f"run-{uuid.uuid4().hex}"  # a run never finds another run's prompts cached
    constrained = set(range(0, len(arrivals), round(1 / fraction))) if fraction else set()
    extra = {}
    if constrained:
        from common.structured_outputs import StructuredOutputs  # new code only

        extra = {"structured_outputs": StructuredOutputs.from_schema(SCHEMA, True, "response_format")}

    async def send(index: int):
        arrival = arrivals[index]
        settings = extra if index in constrained else {}
        return await client.send(arrival.prompt, greedy(arrival.max_tokens, cache_salt=salt, **settings))

    wall_s, served = asyncio.run(closed_loop(send, list(range(len(arrivals))), CONCURRENCY))
    assert all(s.timing.output_len == a.max_tokens for s, a in zip(served, arrivals, strict=True))
    return summarize(wall_s, [s.timing for s in served])


def worker() -> None:
    """Reads a fraction per line; answers each with one `RESULT {...}` line."""
    from bench.driver import EngineClient, engine_as_served

    try:
        from bench.serving.cpu_serving import shipped_tokenizer, workload
    except ModuleNotFoundError:  # TODAY's tree, before bench/ was grouped
        from bench.cpu_serving import shipped_tokenizer, workload  # type: ignore[no-redef]

    arrivals = workload(0, shipped_tokenizer())
    client = EngineClient(engine_as_served())
    _run(client, arrivals[:4], 0.0)  # warm: kernels, first steps
    print("READY", flush=True)
    for line in sys.stdin:
        print("RESULT", json.dumps(_run(client, arrivals, float(line))), flush=True)
    client.engine.shutdown()


# -- the driver ---------------------------------------------------------------------------
class Worker:
    def __init__(self, tree: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        # This file, run as __main__ from `tree` (whose modules it then imports: -c puts the
        # working directory first on the path; run as a script, bench/ would shadow `router`).
        script = (
            "import runpy, sys; sys.argv = ['structured', '--worker']; "
            f"runpy.run_path({str(Path(__file__))!r}, run_name='__main__')"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            cwd=tree,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._expect("READY")

    def _expect(self, word: str) -> str:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(word):
                return line[len(word) :].strip()
        raise RuntimeError(f"worker exited (code {self.process.wait()})")

    def run(self, fraction: float) -> dict[str, float]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{fraction}\n")
        self.process.stdin.flush()
        return json.loads(self._expect("RESULT"))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def today_tree() -> Path:
    tree = Path("/tmp") / f"stallfree-{TODAY}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), TODAY], check=True)
    return tree


def compile_times() -> dict[str, object]:
    """Per schema, ms: cold (the first time the replica's compiler sees it) and cached (again)."""
    from openai.lib._pydantic import to_strict_json_schema

    from common.structured_outputs import StructuredOutputs
    from harness.pydantic_schemas import SCHEMAS
    from replica_engine.config import EngineConfig
    from replica_engine.engine import build_engine

    _, inputs = build_engine(EngineConfig(num_kv_blocks=16), None)
    specs = [StructuredOutputs.from_schema(SCHEMA, True, "response_format")]
    specs += [
        StructuredOutputs.from_schema(to_strict_json_schema(m), True, "response_format") for m, _ in SCHEMAS
    ]
    unique = list(dict.fromkeys(specs))  # equal specs (the field they came from aside) compile alike
    cold, cached = [], []
    for spec in unique:
        assert inputs.grammars is not None
        started = time.perf_counter()
        inputs.grammars.compile(spec)
        cold.append(1000 * (time.perf_counter() - started))
        started = time.perf_counter()
        inputs.grammars.compile(spec)
        cached.append(1000 * (time.perf_counter() - started))
    return {
        "schemas": len(unique),
        "cold_ms": {"median": statistics.median(cold), "max": max(cold), "this_benchmark's": cold[0]},
        "cached_ms": {"median": statistics.median(cached), "max": max(cached)},
    }


def main() -> None:
    from bench.driver import BenchmarkRun, Spread, print_verdicts

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/structured.json")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    run = BenchmarkRun("structured", args.output, GOALS)
    compiling = compile_times()
    print("compile", json.dumps(compiling), flush=True)
    workers = {"today": Worker(today_tree()), "ours": Worker(REPO)}
    runs: dict[str, list[dict[str, float]]] = {"today 0%": [], **{f"ours {f:.0%}": [] for f in FRACTIONS}}
    order = [("today", 0.0)] + [("ours", f) for f in FRACTIONS]
    try:
        for round_index in range(args.rounds):
            for system, fraction in order if round_index % 2 == 0 else list(reversed(order)):
                result = workers[system].run(fraction)
                name = f"{system} {fraction:.0%}"
                runs[name].append(result)
                print(
                    f"round {round_index} {name}: {result['output_tok_per_s']:.1f} tok/s, "
                    f"TBT p99 {result['tbt_p99_s'] * 1000:.0f} ms",
                    flush=True,
                )
    finally:
        for w in workers.values():
            w.close()
    vs_today = Spread.of_ratios(runs["ours 0%"], runs["today 0%"], "output_tok_per_s")
    tbt_vs_today = Spread.of_ratios(runs["ours 0%"], runs["today 0%"], "tbt_p99_s")
    by_fraction = {
        f: Spread.of_ratios(runs[f"ours {f:.0%}"], runs["ours 0%"], "output_tok_per_s") for f in FRACTIONS
    }
    print(f"0% constrained vs today: tok/s {vs_today:.3f}, TBT p99 {tbt_vs_today:.3f}")
    for fraction, ratio in by_fraction.items():
        print(f"{fraction:.0%} constrained vs 0%: tok/s {ratio:.3f}")
    goals_met = {
        "unconstrained_tok_per_s_vs_today_min": vs_today.median
        >= GOALS["unconstrained_tok_per_s_vs_today_min"],
        "unconstrained_tbt_p99_vs_today_max": tbt_vs_today.median
        <= GOALS["unconstrained_tbt_p99_vs_today_max"],
        "all_constrained_tok_per_s_vs_unconstrained_min": by_fraction[1.0].median
        >= GOALS["all_constrained_tok_per_s_vs_unconstrained_min"],
    }
    print_verdicts(goals_met)
    body = {
        "settings": {"today": TODAY, "rounds": args.rounds, "concurrency": CONCURRENCY, "schema": SCHEMA},
        "compile": compiling,
        "unconstrained_vs_today": {"tok_per_s": vars(vs_today), "tbt_p99": vars(tbt_vs_today)},
        "constrained_vs_unconstrained_tok_per_s": {f"{f:.0%}": vars(r) for f, r in by_fraction.items()},
        "runs": runs,
    }
    run.write(body, goals_met)


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
