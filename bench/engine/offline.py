"""`python -m bench offline`: our engine against Hugging Face static batching, same model, same
machine, same run. 32 requests (prompt 16-512, output 16-128 tokens, fixed seed) arrive at once;
greedy with ignore_eos, so both produce exactly the requested tokens. Writes
bench/results/offline_cpu.json, .png and .raw.json.gz (each request's timing)."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from bench.driver import BenchmarkRun, Workload, greedy, pyplot, uniform_workload
from bench.engine import hf_static
from common.latency import RequestTiming, summarize
from common.model_source import DEFAULT_MODEL, resolve_model
from replica_engine import LLM

GOALS = {"throughput_ratio_min": 2.0, "ttft_p50_ratio_max": 0.3}


def run_engine(llm: LLM, workload: Workload) -> tuple[float, list[RequestTiming]]:
    engine = llm.engine
    start = time.perf_counter()
    ids = [
        engine.add_request(prompt, greedy(n))
        for prompt, n in zip(workload.prompts, workload.output_lens, strict=True)
    ]
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - start
            if out.new_token_ids:
                first_token.setdefault(out.request_id, now)
            if out.finished:
                finished[out.request_id] = now
    wall = time.perf_counter() - start
    timings = [
        RequestTiming(len(p), n, first_token[i], finished[i])
        for i, p, n in zip(ids, workload.prompts, workload.output_lens, strict=True)
    ]
    return wall, timings


def _print_table(rows: dict[str, dict[str, float]]) -> None:
    columns = ["wall_s", "output_tok_per_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s"]
    print("system".ljust(44) + "".join(c.rjust(17) for c in columns))
    for name, summary in rows.items():
        print(name.ljust(44) + "".join(f"{summary[c]:>17.2f}" for c in columns))


def _plot(path: Path, raw: dict[str, list[dict]]) -> None:
    """Per system, each request's timing (as in the side file, bench.driver.raw_path)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in raw.items():
        for axis, field in zip(axes, ("ttft_s", "e2e_s"), strict=True):
            xs = sorted(t[field] for t in values)
            axis.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    for axis, title in zip(axes, ("time to first token (s)", "end-to-end latency (s)"), strict=True):
        axis.set_xlabel(title)
        axis.set_ylabel("fraction of requests")
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-sizes", default="8,32", help="static batch sizes to run the baseline at")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--dtype", default="auto", help="ours and the baseline's (auto: the engine's default)"
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/offline_cpu.json"))
    args = parser.parse_args()
    run = BenchmarkRun("offline", args.output, GOALS)

    llm = LLM(DEFAULT_MODEL, max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
    tokenizer = llm.tokenizer
    workload = uniform_workload(
        args.num_requests, (16, 512), (16, 128), (100, len(tokenizer) - 100), args.seed
    )
    hf_model = hf_static.load(
        resolve_model(DEFAULT_MODEL).hf_dir, llm.engine.config.torch_dtype
    )  # same dtype
    warm = Workload([workload.prompts[0][:16]], [2])
    run_engine(llm, warm)
    hf_static.run(hf_model, tokenizer.pad_token_id, warm, 1)

    config = llm.engine.config
    ours_name = f"stallfree ({config.scheduling_policy}, budget {config.max_num_batched_tokens})"
    timings = {ours_name: run_engine(llm, workload)}
    for batch_size in map(int, args.hf_batch_sizes.split(",")):
        timings[f"transformers static (bs {batch_size})"] = hf_static.run(
            hf_model, tokenizer.pad_token_id, workload, batch_size
        )
    summaries = {name: summarize(wall, records_) for name, (wall, records_) in timings.items()}
    _print_table(summaries)

    # Judge each goal against the baseline that is strongest on that metric.
    ours = summaries[ours_name]
    baselines = {name: s for name, s in summaries.items() if name != ours_name}
    best_throughput = max(baselines, key=lambda name: baselines[name]["output_tok_per_s"])
    best_ttft = min(baselines, key=lambda name: baselines[name]["ttft_p50_s"])
    ratios = {
        "throughput_ratio": ours["output_tok_per_s"] / baselines[best_throughput]["output_tok_per_s"],
        "throughput_baseline": best_throughput,
        "ttft_p50_ratio": ours["ttft_p50_s"] / baselines[best_ttft]["ttft_p50_s"],
        "ttft_p50_baseline": best_ttft,
    }
    met = {
        "throughput": ratios["throughput_ratio"] >= GOALS["throughput_ratio_min"],
        "ttft_p50": ratios["ttft_p50_ratio"] <= GOALS["ttft_p50_ratio_max"],
    }
    verdict = {True: "PASS", False: "MISS"}
    throughput, ttft = ratios["throughput_ratio"], ratios["ttft_p50_ratio"]
    print(f"throughput vs {best_throughput}: {throughput:.2f}x (goal >= 2.0: {verdict[met['throughput']]})")
    print(f"p50 TTFT vs {best_ttft}: {ttft:.2f}x (goal <= 0.3: {verdict[met['ttft_p50']]})")

    body = {
        "workload": {
            "num_requests": args.num_requests,
            "seed": args.seed,
            "prompt_len": [16, 512],
            "output_len": [16, 128],
            "arrival": "all at t=0",
            "sampling": "greedy, ignore_eos",
        },
        "engine": {
            "model": DEFAULT_MODEL,
            "dtype": config.dtype,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_num_seqs": config.max_num_seqs,
            "block_size": config.block_size,
            "scheduling_policy": config.scheduling_policy,
        },
        "baseline": "transformers generate on static batches in arrival order, left-padded, same dtype",
        "summaries": summaries,
        "ratios": ratios,
    }
    raw = {name: [asdict(t) for t in records_] for name, (_, records_) in timings.items()}
    run.write(body, met, raw)
    _plot(args.output.with_suffix(".png"), raw)


if __name__ == "__main__":
    main()
