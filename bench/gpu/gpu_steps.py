"""bench.gpu's step timings: decode steps against the memory floor, mixed steps (the stall-free
scheduler's decodes beside a prompt chunk) against the FLOP floor, on a `dummy:` model whose
weights are generated on the device.

Floors: a step's bytes (every weight once plus the KV cache it attends over) at the device's HBM
bandwidth, and its FLOPs at its dense bf16 rate, from the spec sheet where the device is known
(H100 SXM: 3.35 TB/s, 989 TFLOP/s); the device's own copy bandwidth and matmul rate are measured
beside them, and are the floors on a device no spec sheet names (the CPU of a dry run)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from bench.engine.floors import best_time
from bench.engine.step_timing import ModelTime, StepResult, step_result, time_decode_steps, time_mixed_steps
from replica_engine import EngineConfig, LLMEngine

GOAL_RATIO = 1.5  # the goal holds decode steps at batch >= GOAL_MIN_BATCH to it (HBM floor)
GOAL_MIN_BATCH = 32
SPEC_SHEETS = {  # device name contains -> (HBM bytes/s, dense bf16 FLOP/s)
    "H100 80GB HBM3": (3.35e12, 989e12),
    "H100 PCIe": (2.0e12, 756e12),
    "H200": (4.8e12, 989e12),
}


@dataclass(frozen=True)
class DeviceRates:
    name: str
    bytes_per_s: float  # the floors'
    flops_per_s: float
    source: str  # spec sheet, or measured here
    measured_bytes_per_s: float  # a device-to-device copy, bytes read and written
    measured_bf16_flops_per_s: float  # a square bf16 matmul


def _synced(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """`fn`, then waiting for the device: a GPU's work is timed when done, not when launched."""

    def run() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def device_rates(device: torch.device, dry_run: bool) -> DeviceRates:
    on_gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    copy_bytes, size = (64 << 20, 512) if dry_run else (2 << 30, 8192)
    source = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    copied = 2 * copy_bytes / best_time(_synced(lambda: target.copy_(source), device), 5)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    flops = 2 * size**3 / best_time(_synced(lambda: a @ a, device), 5)
    spec = next((rates for key, rates in SPEC_SHEETS.items() if key in name), None)
    if spec is None:
        return DeviceRates(name, copied, flops, "measured here", copied, flops)
    return DeviceRates(name, *spec, "spec sheet", copied, flops)


@dataclass(frozen=True)
class StepPlan:
    model: str  # a dummy: shape
    decode_batches: tuple[int, ...]
    context: int  # tokens per decoding request
    mixed: tuple[tuple[int, int], ...]  # (decodes, prompt chunk); their sum is the budget
    num_steps: int
    kv_cache_bytes: int | None  # None: what gpu_memory_utilization leaves


def measure(plan: StepPlan, device: str, rates: DeviceRates) -> list[StepResult]:
    """Decode steps eagerly and replayed from CUDA graphs (cases `decode-b<B>` and `... graphs`),
    then the mixed steps (never captured: they hold prompt chunks)."""
    dtype = "bfloat16"
    floor_rates = (rates.bytes_per_s, rates.flops_per_s)
    common = dict(
        model=plan.model,
        dtype=dtype,
        device=device,
        attention_backend="triton",
        kv_cache_bytes=plan.kv_cache_bytes,
    )
    results = []
    for graphs in (False, True):
        engine = decode_engine(plan.model, device, max(plan.decode_batches), plan.kv_cache_bytes, graphs)
        model_time = ModelTime(engine)
        for batch in plan.decode_batches:
            timing, work = time_decode_steps(engine, model_time, batch, plan.context, plan.num_steps)
            case = f"decode-b{batch}" + (" graphs" if graphs else "")
            results.append(step_result(dtype, case, timing, work, floor_rates, True, GOAL_RATIO))
        del engine, model_time
        free_device_memory()
    for decodes, chunk in plan.mixed:
        config = EngineConfig(
            **common,
            max_num_batched_tokens=decodes + chunk,
            max_num_seqs=max(decodes, 1) + 1,
            enable_prefix_caching=False,
        )
        engine = LLMEngine(config)
        timing, work = time_mixed_steps(
            engine, ModelTime(engine), decodes, chunk, plan.context, plan.num_steps
        )
        case = f"mixed-{decodes}+{chunk}"
        results.append(step_result(dtype, case, timing, work, floor_rates, False, GOAL_RATIO))
        del engine
        free_device_memory()
    return results


def decode_engine(
    model: str, device: str, max_batch: int, kv_cache_bytes: int | None, graphs: bool
) -> LLMEngine:
    """An engine for decode steps at batches up to `max_batch`, in bfloat16 on the Triton attention."""
    config = EngineConfig(
        model=model,
        dtype="bfloat16",
        device=device,
        attention_backend="triton",
        kv_cache_bytes=kv_cache_bytes,
        max_num_batched_tokens=max_batch * 64,  # prompts computed in a few steps, not one huge one
        max_num_seqs=max_batch,
        cuda_graphs=graphs,
    )
    return LLMEngine(config)


def free_device_memory() -> None:
    """The last engine's weights and KV pool gone before the next one sizes its pool."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def summary(rates: DeviceRates, results: list[StepResult]) -> dict:
    return {"device": asdict(rates), "steps": [asdict(r) for r in results]}
