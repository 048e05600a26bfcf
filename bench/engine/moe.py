"""`python -m bench moe`: decode steps of a mixture of experts on this CPU against the floor of the
experts they touch, measured in the same run.

The model is `dummy:small-moe` (Qwen3-MoE's layout: 12 layers of 64 experts of width 256, 8 per
token; 0.6B weights, 0.2B active), through LLMEngine, in bfloat16 (the packed kernel) and with
int8 experts and projections (the quantized kernel, bfloat16 activations). Its dummy router
weights are near zero, so tokens pick experts near uniformly: the most a batch can touch, the
case the roofline assumes. Per batch (1, 4, 16, 64 decodes, ~260 tokens of context each): the
median step, the experts it read (distinct experts picked, summed over layers, from a hook on
each layer's experts), the share of the step inside the experts, and two floors from
bench/engine/floors.py's rates measured first: the touched-expert floor (the weights a step must
read, with only the experts its tokens picked, plus its KV cache, at the best read bandwidth; or
its FLOPs at the matmul rate if larger) and, for scale, the all-expert floor a step reading every
expert would have.

Goal (issue 61): every decode step <= 2x its touched-expert floor."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.driver import BenchmarkRun, print_verdicts
from bench.engine.cpu import BF16_RATE, QUANTIZED_RATE, Variant
from bench.engine.floors import measure_floors
from bench.engine.step_timing import (
    ExpertUse,
    ModelTime,
    StepWork,
    expert_bytes,
    step_result,
    time_decode_steps,
)
from replica_engine import LLMEngine
from replica_engine.models.moe import SparseMoeBlock

MODEL = "dummy:small-moe"
GOAL_RATIO = 2.0
BATCHES = (1, 4, 16, 64)
CONTEXT = 260
VARIANTS = (
    Variant("bfloat16", "bfloat16", "none", (BF16_RATE,)),
    Variant("int8", "bfloat16", "int8", (QUANTIZED_RATE,)),
)


@dataclass(frozen=True)
class MoeStep:
    variant: str
    batch: int
    step_ms: float
    model_ms: float
    experts_ms: float  # inside the layers' experts
    experts_share: float  # of the step
    experts_read: float  # distinct experts picked, summed over layers
    experts_held: int  # every layer's experts
    floor_ms: float  # the touched experts'
    all_experts_floor_ms: float  # had the step read every expert
    ratio: float  # step / floor
    goal_met: bool


def measure(variant: Variant, floors: dict, num_steps: int) -> list[MoeStep]:
    config = variant.config(
        model=MODEL, max_num_batched_tokens=max(BATCHES) * CONTEXT, max_num_seqs=128, num_kv_blocks=1200
    )
    engine = LLMEngine(config)
    model_time, expert_use = ModelTime(engine), ExpertUse(engine)
    rates = floors["read_gb_per_s"] * 1e9, max(floors[r] for r in variant.rates) * 1e9
    layers = engine.core.runner.model.model.layers
    held = sum(layer.mlp.shape.num_experts for layer in layers if isinstance(layer.mlp, SparseMoeBlock))
    one_expert = expert_bytes(engine)
    results = []
    for batch in BATCHES:
        timing, work = time_decode_steps(engine, model_time, batch, CONTEXT, num_steps, expert_use)
        read, experts_s = expert_use.median(num_steps)
        touched = step_result(variant.name, f"decode-b{batch}", timing, work, rates, True, GOAL_RATIO)
        every = StepWork(work.bytes_read + (held - read) * one_expert, work.flops)
        all_floor = step_result(variant.name, "", timing, every, rates, True, GOAL_RATIO)
        results.append(
            MoeStep(
                variant.name,
                batch,
                touched.step_ms,
                touched.model_ms,
                experts_s * 1e3,
                experts_s / timing.step_s,
                read,
                held,
                touched.floor_ms,
                all_floor.floor_ms,
                touched.ratio,
                touched.goal_met,
            )
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--decode-steps", type=int, default=10, help="timed decode steps per batch")
    parser.add_argument("--output", type=Path, default=Path("bench/results/cpu_moe.json"))
    args = parser.parse_args()
    run = BenchmarkRun("moe", args.output, {"decode_ratio_max": GOAL_RATIO})
    floors, floor_methods = measure_floors()
    print(f"read {floors['read_gb_per_s']:.1f} GB/s; " + ", ".join(f"{k} {v:.1f}" for k, v in floors.items()))
    results = [step for variant in VARIANTS for step in measure(variant, floors, args.decode_steps)]
    print(f"{'variant':10}{'batch':>6}{'step ms':>9}{'experts ms':>12}{'read':>7}{'floor ms':>10}"
          f"{'all-expert floor':>18}{'ratio':>8}")  # fmt: skip
    for r in results:
        verdict = "" if r.goal_met else f"  MISS (goal <= {GOAL_RATIO}x)"
        print(
            f"{r.variant:10}{r.batch:>6}{r.step_ms:>9.1f}{r.experts_ms:>7.1f} ({r.experts_share:>3.0%})"
            f"{r.experts_read:>5.0f}/{r.experts_held}{r.floor_ms:>9.1f}{r.all_experts_floor_ms:>18.1f}"
            f"{r.ratio:>7.2f}x{verdict}"
        )
    goals_met = {
        f"{r.variant}/decode-b{r.batch} <= {GOAL_RATIO}x touched-expert floor": r.goal_met for r in results
    }
    print_verdicts(goals_met)
    body = {
        "model": MODEL,
        "settings": {"decode_steps": args.decode_steps, "context": CONTEXT, "batches": BATCHES},
        "floor_definition": "max(bytes read / read bandwidth, FLOPs / matmul rate); bytes = every "
        "weight but the experts once, the experts the step's tokens picked, the KV cache of every context",
        "floors": floors,
        "floor_methods": floor_methods,
        "steps": [asdict(r) for r in results],
    }
    run.write(body, goals_met)


if __name__ == "__main__":
    main()
