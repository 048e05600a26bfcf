"""`python -m bench.cpu`: engine steps on this CPU against the machine's own physical floors, both
measured in the same run.

1. Floors, measured first (bench/floors.py): the best bytes per second of several methods (a sum,
   a copy, weight-streaming GEMVs in each dtype through torch and the engine's kernel) and the
   best matmul rate of each dtype (square sizes and the shapes a step runs). This machine is
   shared: each method is the best of 10 runs.
2. Steps of the real SmolLM2 through LLMEngine, per dtype: decode at batch 1/8/16/32/64 with ~260
   tokens of context per request, one 512-token prefill step, and the mixed steps a 256-token
   budget makes under load (16 decodes + a 240-token prompt chunk; 64 + 192). Each: median step time, the
   part spent in the model's forward and sampling (as the runner reports it in each step's
   summary, read by a step listener; the rest is overhead: scheduling, the batch's inputs,
   applying outputs), and the floor: the bytes a step must read (weights, plus the KV cache it
   attends over) at the read bandwidth, or its FLOPs at the dtype's matmul rate, whichever is
   larger.

Goals (issues 13, 23 and 36): decode and mixed steps <= 1.5x their floor at every batch; prefill
<= 1.5x the dtype's matmul floor; step overhead <= 5% of a bf16 decode step at batch 64.

Then, unless --parts says otherwise, bench.dtype_agreement (bf16 vs fp32 outputs) and
bench.cpu_serving (issue 23's HTTP workload, side by side with the installed peers): about 35
minutes in all."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.driver import BenchmarkRun
from bench.floors import DTYPES, measure_floors
from replica_engine import EngineConfig, LLMEngine, SamplingParams
from replica_engine.scheduler.plan import StepSummary

GOAL_RATIO = 1.5
GOAL_OVERHEAD_SHARE = 0.05  # of a bf16 decode step at batch 64 (issue 36)
DECODE_BATCHES = (1, 8, 16, 32, 64)
# (decodes, prompt chunk): the steps a 256-token budget makes under serving load
MIXED_STEPS = ((16, 240), (64, 192))
CONTEXT = 260  # tokens per request when a decode step is timed
PREFILL_TOKENS = 512
PARTS = ("steps", "agreement", "serving")


@dataclass(frozen=True)
class StepWork:
    """What one step must move and compute, for its floor."""

    bytes_read: float
    flops: float


def step_work(engine: LLMEngine, rows: list[tuple[int, int]], num_sampled: int) -> StepWork:
    """Weights read once, the KV cache of every request's context, and the FLOPs of the linear
    layers, attention (QK^T and PV) and the logits of the sampled rows. `rows`: per request, its
    query tokens this step and its context after them."""
    model = engine.core.runner.model
    layers = model.model.layers
    attention = layers[0].self_attn
    itemsize = engine.config.torch_dtype.itemsize
    linear_params = sum(
        m.in_features * m.out_features for m in layers.modules() if isinstance(m, torch.nn.Linear)
    )
    vocab_params = model.model.embed_tokens.weight.numel()  # the logits' matrix, tied or not
    kv_per_token = len(layers) * 2 * attention.num_kv_heads * attention.head_dim * itemsize
    attention_flops = sum(
        4 * q * (ctx - q / 2) * attention.num_heads * attention.head_dim * len(layers) for q, ctx in rows
    )
    num_tokens = sum(q for q, _ in rows)
    return StepWork(
        bytes_read=(linear_params + vocab_params) * itemsize + kv_per_token * sum(ctx for _, ctx in rows),
        flops=2 * num_tokens * linear_params + 2 * num_sampled * vocab_params + attention_flops,
    )


@dataclass(frozen=True)
class StepResult:
    dtype: str
    case: str  # decode-b<B> or prefill-512
    step_ms: float  # median wall time of the step (LLMEngine.step: the core's step and outputs)
    model_ms: float  # of which in the model's forward and sampling
    overhead_ms: float  # the rest: scheduling, the batch's inputs, applying and emitting outputs
    overhead_share: float  # overhead / step
    floor_ms: float
    floor_kind: str  # memory or compute
    ratio: float  # step / floor
    goal_met: bool


class _ModelTime:
    """A step listener: the model's share of the latest step, from its summary."""

    def __init__(self, engine: LLMEngine) -> None:
        self.last_s = 0.0
        engine.step_listeners.append(self)

    def __call__(self, summary: StepSummary) -> None:
        self.last_s = summary.model_s


def _timed_steps(engine: LLMEngine, model_time: _ModelTime, count: int) -> tuple[float, float]:
    steps, model = [], []
    for _ in range(count):
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
        model.append(model_time.last_s)
    return statistics.median(steps), statistics.median(model)


def _result(
    dtype: str, case: str, timing: tuple[float, float], work: StepWork, floors: dict, memory_bound: bool
) -> StepResult:
    step_s, model_s = timing
    memory_s = work.bytes_read / (floors["read_gb_per_s"] * 1e9)
    compute_s = work.flops / (floors[f"matmul_{dtype}_gflop_per_s"] * 1e9)
    floor_s = max(memory_s, compute_s) if memory_bound else compute_s
    kind = "memory" if memory_bound and memory_s >= compute_s else "compute"
    ratio = step_s / floor_s
    return StepResult(
        dtype,
        case,
        step_s * 1e3,
        model_s * 1e3,
        (step_s - model_s) * 1e3,
        (step_s - model_s) / step_s,
        floor_s * 1e3,
        kind,
        ratio,
        ratio <= GOAL_RATIO,
    )


def _add_decoders(engine: LLMEngine, count: int, params: SamplingParams) -> list[str]:
    """`count` requests of CONTEXT - 1 distinct prompt tokens each, to decode from."""
    return [
        engine.add_request([1000 + (7 * i + j) % 20000 for j in range(CONTEXT - 1)], params)
        for i in range(count)
    ]


def measure_steps(dtype: str, floors: dict, decode_steps: int) -> list[StepResult]:
    engine = LLMEngine(
        EngineConfig(dtype=dtype, max_num_batched_tokens=64 * CONTEXT, max_num_seqs=128, num_kv_blocks=2048)
    )
    model_time = _ModelTime(engine)
    results = []
    for batch in DECODE_BATCHES:
        params = SamplingParams(max_tokens=decode_steps + 2, temperature=0, ignore_eos=True)
        ids = _add_decoders(engine, batch, params)
        engine.step()  # every prompt in one step: from here on, each step decodes `batch` rows
        timing = _timed_steps(engine, model_time, decode_steps)
        work = step_work(engine, [(1, CONTEXT + decode_steps // 2)] * batch, num_sampled=batch)
        results.append(_result(dtype, f"decode-b{batch}", timing, work, floors, memory_bound=True))
        for request_id in ids:
            engine.abort_request(request_id)
    prefill_params = SamplingParams(max_tokens=1, temperature=0)
    timings = []
    for i in range(3):  # one prompt at a time: each step computes exactly 512 prompt tokens
        engine.add_request([500 + (11 * i + j) % 20000 for j in range(PREFILL_TOKENS)], prefill_params)
        timings.append(_timed_steps(engine, model_time, 1))
    timing = (statistics.median(t[0] for t in timings), statistics.median(t[1] for t in timings))
    work = step_work(engine, [(PREFILL_TOKENS, PREFILL_TOKENS)], num_sampled=1)
    results.append(_result(dtype, f"prefill-{PREFILL_TOKENS}", timing, work, floors, memory_bound=False))
    return results


def measure_mixed_steps(dtype: str, floors: dict, num_steps: int) -> list[StepResult]:
    """Steps of `decodes` requests decoding (each ~CONTEXT tokens in) beside a long prompt's
    chunk, as the stall-free scheduler makes them with a 256-token budget."""
    budget = sum(MIXED_STEPS[0])
    config = EngineConfig(
        dtype=dtype,
        max_num_batched_tokens=budget,
        max_num_seqs=128,
        num_kv_blocks=2048,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    model_time = _ModelTime(engine)
    scheduler = engine.core.scheduler
    summaries: list[StepSummary] = []
    engine.step_listeners.append(summaries.append)
    results = []
    for decodes, chunk in MIXED_STEPS:
        assert decodes + chunk == budget
        warm_up_steps = -(-decodes * CONTEXT // chunk) + 1  # until every prompt is in
        params = SamplingParams(max_tokens=warm_up_steps + num_steps + 2, temperature=0, ignore_eos=True)
        ids = _add_decoders(engine, decodes, params)
        while scheduler.waiting or any(r.num_owed_tokens > 1 for r in scheduler.running):
            engine.step()
        contexts = [r.num_tokens + num_steps // 2 for r in scheduler.running]
        prompt = [300 + (13 * j) % 20000 for j in range(chunk * (num_steps + 1))]
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0)))
        summaries.clear()
        timing = _timed_steps(engine, model_time, num_steps)
        shapes = {(s.num_decode_requests, s.num_prefill_tokens) for s in summaries}
        assert shapes == {(decodes, chunk)}, f"steps were not {decodes} decodes + {chunk}: {shapes}"
        rows = [(1, ctx) for ctx in contexts] + [(chunk, chunk * (num_steps // 2 + 1))]
        work = step_work(engine, rows, num_sampled=decodes)
        case = f"mixed-{decodes}+{chunk}"
        results.append(_result(dtype, case, timing, work, floors, memory_bound=True))
        for request_id in ids:
            engine.abort_request(request_id)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which of {PARTS} to run")
    parser.add_argument("--decode-steps", type=int, default=10, help="timed decode steps per batch")
    parser.add_argument("--output", type=Path, default=Path("bench/results/cpu_steps.json"))
    args = parser.parse_args()
    parts = args.parts.split(",")
    if "steps" in parts:
        run_steps(args.decode_steps, args.output)
    # Each in a fresh process: an engine stepped on a thread of a process whose main thread has
    # already run torch's OpenMP regions is ~30% slower (see AsyncEngine), which would skew the
    # serving benchmark's engine-alone figure.
    for part, module in (("agreement", "bench.dtype_agreement"), ("serving", "bench.cpu_serving")):
        if part in parts:
            subprocess.run([sys.executable, "-m", module], check=True)


def run_steps(decode_steps: int, output: Path) -> None:
    goals = {
        "decode_ratio_max": GOAL_RATIO,
        "mixed_ratio_max": GOAL_RATIO,
        "prefill_ratio_max": GOAL_RATIO,
        "bf16_decode_b64_overhead_share_max": GOAL_OVERHEAD_SHARE,
    }
    run = BenchmarkRun("cpu", output, goals)
    floors, floor_methods = measure_floors()
    for kind, by_method in floor_methods.items():
        print(
            f"{kind}: best {floors[kind]:.1f} of " + ", ".join(f"{m} {v:.1f}" for m, v in by_method.items())
        )
    results = [
        result
        for dtype in DTYPES
        for result in [
            *measure_steps(dtype, floors, decode_steps),
            *measure_mixed_steps(dtype, floors, decode_steps),
        ]
    ]
    columns = f"{'step ms':>10}{'model ms':>10}{'overhead ms':>13}{'floor ms':>10}"
    print(f"{'dtype':10}{'case':14}{columns}  bound   ratio")
    for r in results:
        verdict = "" if r.goal_met else f"  MISS (goal <= {GOAL_RATIO}x)"
        print(
            f"{r.dtype:10}{r.case:14}{r.step_ms:>10.1f}{r.model_ms:>10.1f}"
            f"{r.overhead_ms:>7.2f} ({r.overhead_share:>3.0%})"
            f"{r.floor_ms:>10.1f}  {r.floor_kind:8}{r.ratio:>6.2f}x{verdict}"
        )
    goals_met = {f"{r.dtype}/{r.case} <= {GOAL_RATIO}x floor": r.goal_met for r in results}
    [b64] = [r for r in results if r.dtype == "bfloat16" and r.case == "decode-b64"]
    overhead_met = b64.overhead_share <= GOAL_OVERHEAD_SHARE
    goals_met[f"bf16 decode-b64 overhead <= {GOAL_OVERHEAD_SHARE:.0%} of the step"] = overhead_met
    verdict = "" if overhead_met else "  MISS"
    goal = f"goal <= {GOAL_OVERHEAD_SHARE:.0%}"
    print(f"step overhead at bf16 decode-b64: {b64.overhead_share:.1%} ({goal}){verdict}")
    body = {
        "settings": {
            "decode_steps": decode_steps,
            "context": CONTEXT,
            "prefill_tokens": PREFILL_TOKENS,
            "mixed_steps": MIXED_STEPS,
        },
        "floor_definition": "max(bytes read / read bandwidth, FLOPs / matmul rate) for decode and mixed; "
        "FLOPs / matmul rate for prefill; bytes = every weight once + the KV cache of every context",
        "floors": floors,
        "floor_methods": floor_methods,
        "steps": [asdict(r) for r in results],
    }
    run.write(body, goals_met)


if __name__ == "__main__":
    main()
