"""Many fine-tunes on one replica: what serving four LoRA adapters beside the base model costs.

16 clients in a closed loop send the same requests (text prompts 16-512 tokens, 16-128 greedy
output tokens) to the engine as the app builds its replica's (core on a thread, every core):
- base only: every request to the base model, on an engine without LoRA (what a user who serves
  no adapters runs);
- mixed: the same requests spread round-robin over the base model and four adapters (real PEFT
  adapters, rank 8 on all seven projections, random weights), on an engine with `max_loras` 4.
Runs alternate base, mixed, base, mixed... over seeds: each ratio is taken within a pair. On-demand
load time per adapter is the engine's own timing of its first load from disk (read, checked,
tensors in host memory), taken in the warm-up; each run uses a fresh cache salt.

    python -m bench lora [--seeds 3] [--output bench/results/lora.json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from bench.driver import Arrival, BenchmarkRun, EngineClient, Spread, engine_as_served, greedy, print_verdicts
from common.latency import summarize
from common.lora import LoRARequest
from harness.pacing import closed_loop

NUM_REQUESTS = 48
CONCURRENCY = 16
NUM_ADAPTERS = 4
ADAPTER_RANK = 8
GOALS = {
    "mixed_vs_base_tok_per_s_min": 0.8,  # output tok/s, c=16, median over paired runs
    "mixed_vs_base_tbt_p99_max": 1.25,
}


def workload(seed: int, tokenizer) -> list[Arrival]:
    from bench.serving.cpu_serving import workload as text_workload

    return text_workload(seed, tokenizer, NUM_REQUESTS, (16, 512), (16, 128))


def build_adapters(root: Path) -> list[LoRARequest]:
    import torch
    from transformers import AutoModelForCausalLM

    from common.model_source import DEFAULT_MODEL, resolve_model
    from harness.lora_adapters import save_random_adapter

    hf_model = AutoModelForCausalLM.from_pretrained(resolve_model(DEFAULT_MODEL).hf_dir, dtype=torch.float32)
    return [
        LoRARequest(
            f"adapter-{i}",
            str(save_random_adapter(hf_model, root / f"adapter-{i}", seed=i, rank=ADAPTER_RANK)),
        )
        for i in range(NUM_ADAPTERS)
    ]


def run(client: EngineClient, arrivals: list[Arrival], loras: list[LoRARequest | None], salt: str) -> dict:
    adapter_of = {id(arrival): loras[i % len(loras)] for i, arrival in enumerate(arrivals)}

    def send(arrival: Arrival):
        params = greedy(arrival.max_tokens, cache_salt=salt, lora=adapter_of[id(arrival)])
        return client.send(arrival.prompt, params)

    wall_s, served = asyncio.run(closed_loop(send, arrivals, CONCURRENCY))
    return summarize(wall_s, [s.timing for s in served])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("bench/results/lora.json"))
    args = parser.parse_args(argv)
    bench = BenchmarkRun("lora", args.output, GOALS)
    from bench.serving.cpu_serving import shipped_tokenizer

    tokenizer = shipped_tokenizer()
    with tempfile.TemporaryDirectory() as root:
        adapters = build_adapters(Path(root))
        mixed_loras: list[LoRARequest | None] = [None, *adapters]
        base = EngineClient(engine_as_served({"core_process": False}))
        mixed = EngineClient(  # the same settings, with LoRA on
            engine_as_served({"core_process": False, "enable_lora": True, "max_loras": NUM_ADAPTERS})
        )
        try:
            warm = workload(99, tokenizer)[:20]
            run(base, warm, [None], "warm")
            run(mixed, warm, mixed_loras, "warm")
            load_times = dict(mixed.engine.client.core.runner.lora.load_times_s)
            resolved = mixed.engine.inputs.config  # what `auto` chose on this host
            engine = {k: getattr(resolved, k) for k in ("dtype", "quantization", "attention_backend")}
            runs: dict[str, list[dict]] = {"base": [], "mixed": []}
            for seed in range(args.seeds):
                arrivals = workload(seed, tokenizer)
                runs["base"].append(run(base, arrivals, [None], f"base-{seed}"))
                runs["mixed"].append(run(mixed, arrivals, mixed_loras, f"mixed-{seed}"))
                print(
                    f"seed {seed}: base {runs['base'][-1]['output_tok_per_s']:.1f} tok/s, "
                    f"mixed {runs['mixed'][-1]['output_tok_per_s']:.1f} tok/s"
                )
        finally:
            base.engine.shutdown()
            mixed.engine.shutdown()
    tok_ratio = Spread.of_ratios(runs["mixed"], runs["base"], "output_tok_per_s")
    tbt_ratio = Spread.of_ratios(runs["mixed"], runs["base"], "tbt_p99_s")
    goals_met = {
        "mixed_vs_base_tok_per_s_min": tok_ratio.median >= GOALS["mixed_vs_base_tok_per_s_min"],
        "mixed_vs_base_tbt_p99_max": tbt_ratio.median <= GOALS["mixed_vs_base_tbt_p99_max"],
    }
    keys = ("output_tok_per_s", "tbt_p99_s", "ttft_p50_s")
    per_seed = {name: {key: [r[key] for r in results] for key in keys} for name, results in runs.items()}
    ratios = {
        key: [m[key] / b[key] for m, b in zip(runs["mixed"], runs["base"], strict=True)]
        for key in ("output_tok_per_s", "tbt_p99_s")
    }
    print(f"{'':8}{'tok/s':>22}{'TBT p99 (ms)':>24}")
    for name, results in runs.items():
        tok = Spread.of_runs(results, "output_tok_per_s")
        tbt = Spread.of(r["tbt_p99_s"] * 1000 for r in results)
        print(f"{name:8}{format(tok, '.1f'):>22}{format(tbt, '.1f'):>24}")
    print(f"mixed / base: tok/s {tok_ratio:.2f}, TBT p99 {tbt_ratio:.2f}")
    print("on-demand load (s): " + ", ".join(f"{k} {v:.3f}" for k, v in load_times.items()))
    print_verdicts(goals_met)
    bench.write(
        {
            "workload": {
                "requests": NUM_REQUESTS,
                "concurrency": CONCURRENCY,
                "prompt_tokens": [16, 512],
                "output_tokens": [16, 128],
                "adapters": NUM_ADAPTERS,
                "adapter_rank": ADAPTER_RANK,
                "target_modules": "q, k, v, o, gate, up, down",
                "spread": "round-robin over the base model and the adapters",
            },
            "engine": engine,
            "seeds": args.seeds,
            "runs": per_seed,
            "mixed_vs_base": ratios,
            "adapter_load_s": load_times,
            "adapter_load_s_median": statistics.median(load_times.values()),
        },
        goals_met,
    )


if __name__ == "__main__":
    main()
