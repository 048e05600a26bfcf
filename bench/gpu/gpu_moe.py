"""bench.gpu's mixture-of-experts part (issue 61): decode steps of a Qwen3-30B-A3B-shaped `dummy:`
model (128 experts of width 768, 8 per token; 61 GB in bfloat16, which fits an 80 GB H100)
against the HBM floor of the weights a step must read: every weight but the experts, plus only
the experts its tokens picked (counted by a hook on each layer's experts in the eager run; the
dummy router's near-zero weights pick near uniformly, the most a batch can touch) and the KV
cache. Eager steps and steps replayed from CUDA graphs (the graphs' steps pick as the eager ones
did: the same requests, the same weights). The offline figure runs beside the dense model's in
gpu.py (`moe` part)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from bench.engine.step_timing import (
    ExpertUse,
    ModelTime,
    StepWork,
    expert_bytes,
    step_result,
    time_decode_steps,
)
from bench.gpu.gpu_steps import DeviceRates, decode_engine, free_device_memory

GOAL_RATIO = 2.0  # decode steps at batch >= GOAL_MIN_BATCH, against the touched-expert floor
GOAL_MIN_BATCH = 32


@dataclass(frozen=True)
class MoePlan:
    model: str  # a dummy: mixture of experts
    decode_batches: tuple[int, ...]
    context: int
    num_steps: int
    kv_cache_bytes: int | None


def measure(plan: MoePlan, device: str, rates: DeviceRates) -> list[dict]:
    """Per batch: eager (`decode-b<B>`) and graphs (`... graphs`) steps, the experts read."""
    floor_rates = (rates.bytes_per_s, rates.flops_per_s)
    results: list[dict] = []
    read_by_batch: dict[int, float] = {}
    for graphs in (False, True):
        engine = decode_engine(plan.model, device, max(plan.decode_batches), plan.kv_cache_bytes, graphs)
        model_time = ModelTime(engine)
        use = None if graphs else ExpertUse(engine)  # a hook would sync inside a graph's capture
        for batch in plan.decode_batches:
            timing, work = time_decode_steps(engine, model_time, batch, plan.context, plan.num_steps, use)
            if use is not None:
                read_by_batch[batch] = use.median(plan.num_steps)[0]
            else:  # the eager run's count, priced on this run's weights
                work = StepWork(work.bytes_read + read_by_batch[batch] * expert_bytes(engine), work.flops)
            case = f"decode-b{batch}" + (" graphs" if graphs else "")
            result = step_result("bfloat16", case, timing, work, floor_rates, True, GOAL_RATIO)
            results.append({**asdict(result), "experts_read": read_by_batch[batch]})
        del engine, model_time, use
        free_device_memory()
    return results


def goal_met(steps: list[dict]) -> bool:
    """Each batch's better ratio (eager or graphs) within the goal, from GOAL_MIN_BATCH up."""
    best: dict[int, float] = {}
    for step in steps:
        batch = int(step["case"].removeprefix("decode-b").removesuffix(" graphs"))
        best[batch] = min(best.get(batch, float("inf")), step["ratio"])
    return bool(best) and all(ratio <= GOAL_RATIO for batch, ratio in best.items() if batch >= GOAL_MIN_BATCH)


def print_table(part: dict) -> None:
    print(f"{part['model']}: {'case':16}{'step ms':>10}{'floor ms':>10}{'experts read':>14}{'ratio':>8}")
    for step in part["steps"]:
        print(f"  {step['case']:16}{step['step_ms']:>10.2f}{step['floor_ms']:>10.3f}"
              f"{step['experts_read']:>14.0f}{step['ratio']:>8.2f}x")  # fmt: skip
    offline = part["offline_graphs"]
    print(
        f"  offline (graphs): {offline['output_tok_per_s']:.0f} output tok/s, {offline['requests']} requests"
    )
