"""bench.gpu's kernels part: what a decode step's device time is made of, so that the decode
goal's MISS (issue 56) says what to fix. Two views of the steps part's model, in one device call:

- The matmuls alone: each linear layer's shape (the fused qkv, o, gate_up and down, and the
  logits) at a decode batch's rows, timed alone, cycling through copies of its weight so that
  none is served from the L2 cache: the weight bytes it reads per second, against the device's
  measured copy bandwidth. Summed over a step (every layer's matmuls and the logits), against
  the weights' HBM floor: how close the matmul library comes to the floor before anything else
  of a step is added.
- A profile: decode steps at a few batches, eagerly and replayed from CUDA graphs, under
  torch.profiler: the device time of every kernel a step runs, grouped by what it does, the
  kernels that take the most, and the bytes per second the matmuls (the weights) and the
  attention (the KV cache it attends over) read in their kernels' time. On a CPU (the dry run)
  the profiler's operators stand in for kernels, and the engine's own C++ matmuls do not show."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.engine.floors import best_time
from bench.engine.step_timing import decoding, step_work
from bench.gpu.gpu_steps import DeviceRates, StepPlan, decode_engine, free_device_memory
from replica_engine import LLMEngine

CATEGORIES = (  # (category, pattern): the first to match a kernel's (or operator's) name
    ("communication", r"nccl|all_?reduce|all_?gather"),  # tensor parallel; before "reduce"
    ("attention", r"attention|attn|fmha|flash"),  # before matmul: flash's names hold cutlass, splitkv
    ("matmul", r"gemm|gemv|cutlass|nvjet|xmma|splitk|aten::(mm|addmm|bmm)$"),
    ("fused pointwise", r"rms_norm|silu_mul|rotary"),
    ("copies", r"memcpy|memset|copy"),
    ("torch elementwise", r"elementwise|reduce|index|gather|scatter|fill|cat|aten::"),
)
OTHER = "other"
TOP_KERNELS = 12
COLD_BYTES = 512 << 20  # a matmul's weight copies together: far past an H200's 50 MB of L2


@dataclass(frozen=True)
class KernelPlan:
    matmul_rows: tuple[int, ...]  # a decode batch's rows, one token each
    profiled_batches: tuple[int, ...]  # at most the steps plan's largest batch
    num_steps: int  # profiled steps at each batch
    matmul_calls: int  # calls timed together, each the best of a few repeats


def category(name: str) -> str:
    return next((kind for kind, pattern in CATEGORIES if re.search(pattern, name, re.IGNORECASE)), OTHER)


def linear_shapes(engine: LLMEngine) -> dict[str, tuple[int, int, int]]:
    """Each matmul of a decode step: name -> (in, out, calls a step). Every layer's linears (the
    first layer's shapes: a dense model's layers are alike) and the logits."""
    model = engine.core.runner.model
    layers = model.model.layers
    shapes = {
        name: (module.in_features, module.out_features, len(layers))
        for name, module in layers[0].named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    shapes["logits"] = (model.config.hidden_size, model.config.vocab_size, 1)
    return shapes


def _matmul_seconds(
    rows: int,
    weight_shape: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    calls: int,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> float:
    """One matmul's seconds, timed over `calls` calls that cycle through copies of the weight."""
    out_features, in_features = weight_shape
    weight_bytes = in_features * out_features * dtype.itemsize
    copies = max(1, math.ceil(COLD_BYTES / weight_bytes)) if device.type == "cuda" else 1
    weights = [torch.randn(out_features, in_features, device=device, dtype=dtype) for _ in range(copies)]
    x = torch.randn(rows, in_features, device=device, dtype=dtype)

    def run() -> None:
        for call in range(calls):
            linear(x, weights[call % copies])
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return best_time(run, 3) / calls


def _split_k_figures(
    rows: int, weight_shape: tuple[int, int], dtype: torch.dtype, device: torch.device, plan: KernelPlan
) -> dict:
    """The split-K candidate at its best config, and how far its output is from the library's."""
    from bench.gpu.split_k_matmul import CONFIGS, split_k_linear

    timed = {
        config: _matmul_seconds(
            rows, weight_shape, dtype, device, plan.matmul_calls, partial(split_k_linear, config=config)
        )
        for config in CONFIGS
    }
    best = min(timed, key=timed.__getitem__)
    x = torch.randn(rows, weight_shape[1], device=device, dtype=dtype)
    weight = torch.randn(weight_shape, device=device, dtype=dtype)
    expected = torch.nn.functional.linear(x, weight).float()
    error = (split_k_linear(x, weight, best).float() - expected).abs().max() / expected.abs().max()
    return {
        "split_k_us": timed[best] * 1e6,
        "split_k_config": best.name,
        "split_k_relative_error": float(error),
    }


def matmuls(engine: LLMEngine, plan: KernelPlan, rates: DeviceRates) -> dict:
    """Each of a step's matmuls alone at each row count (and, at up to 64 rows, the split-K
    candidate's best), and a step's matmuls summed against the weights' floor (the floors'
    bandwidth: the spec sheet's where the device is known)."""
    from bench.gpu import split_k_matmul  # imports Triton: not before a dry run sets TRITON_INTERPRET

    dtype, device = engine.config.torch_dtype, engine.core.runner.device
    shapes = linear_shapes(engine)
    alone, steps = [], []
    for rows in plan.matmul_rows:
        step_s = weight_bytes = 0.0
        for name, (in_features, out_features, per_step) in shapes.items():
            shape = (out_features, in_features)
            seconds = _matmul_seconds(
                rows, shape, dtype, device, plan.matmul_calls, torch.nn.functional.linear
            )
            read = in_features * out_features * dtype.itemsize
            figures = {
                "matmul": name, "in": in_features, "out": out_features, "rows": rows,
                "us": seconds * 1e6,
                "weight_bytes_per_s": read / seconds,
                "of_measured_copy": read / seconds / rates.measured_bytes_per_s,
                "flops_per_s": 2 * rows * in_features * out_features / seconds,
            }  # fmt: skip
            if rows <= split_k_matmul.MAX_ROWS:
                figures |= _split_k_figures(rows, shape, dtype, device, plan)
            alone.append(figures)
            step_s += per_step * seconds
            weight_bytes += per_step * read
        floor_s = weight_bytes / rates.bytes_per_s
        steps.append({"rows": rows, "matmuls_ms": step_s * 1e3, "weights_floor_ms": floor_s * 1e3,
                      "ratio": step_s / floor_s})  # fmt: skip
    return {"alone": alone, "step": steps}


def kernel_times(prof: profile, num_steps: int, on_gpu: bool) -> dict:
    """A profile's kernels (on a CPU: operators) by their own time: per step, by category, and
    the top ones."""
    device = DeviceType.CUDA if on_gpu else DeviceType.CPU
    found = []  # (name, calls, microseconds)
    for event in prof.key_averages():
        micros = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        if event.device_type == device and micros > 0:
            found.append((event.key, event.count, micros))
    total = sum(micros for _, _, micros in found)
    by_category = {kind: 0.0 for kind, _ in CATEGORIES} | {OTHER: 0.0}
    for name, _, micros in found:
        by_category[category(name)] += micros / num_steps / 1e3
    top = sorted(found, key=lambda kernel: -kernel[2])[:TOP_KERNELS]
    return {
        "kernels_ms_per_step": total / num_steps / 1e3,
        "by_category_ms": by_category,
        "top": [_kernel(*kernel, num_steps, total) for kernel in top],
    }


def _kernel(name: str, calls: int, micros: float, num_steps: int, total: float) -> dict:
    return {
        "kernel": name[:160],
        "category": category(name),
        "calls_per_step": calls / num_steps,
        "us_per_call": micros / calls,
        "share": micros / total,
    }


def profile_decode(engine: LLMEngine, batch: int, context: int, num_steps: int) -> dict:
    """`num_steps` decode steps at `batch` under the profiler (after one unprofiled step), and
    what the matmuls and the attention read per second of their kernels' time: the weights, and
    the KV cache of every request's context."""
    on_gpu = engine.core.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with decoding(engine, batch, context, num_steps + 1):
        engine.step()
        contexts = [r.num_tokens + num_steps // 2 for r in engine.core.scheduler.running]
        with profile(activities=activities) as prof:
            for _ in range(num_steps):
                engine.step()
            if on_gpu:
                torch.cuda.synchronize()
    kernels = kernel_times(prof, num_steps, on_gpu)
    weight_bytes = step_work(engine, [(1, 0)] * batch, batch).bytes_read
    kv_bytes = step_work(engine, [(1, ctx) for ctx in contexts], batch).bytes_read - weight_bytes
    by_category = kernels["by_category_ms"]
    read = {"matmul": weight_bytes, "attention": kv_bytes}
    kernels["bytes_per_s"] = {  # a category no kernel showed in (a CPU's C++ matmuls): left out
        kind: num_bytes * 1e3 / by_category[kind] for kind, num_bytes in read.items() if by_category[kind]
    }
    return kernels


def measure(plan: KernelPlan, steps: StepPlan, device: str, rates: DeviceRates) -> dict:
    """The matmuls alone (beside the eager engine), then the profiles: eager, then graphs."""
    assert max(plan.profiled_batches) <= max(steps.decode_batches), "a profiled batch past the steps' engine"
    result: dict = {"model": steps.model, "context": steps.context}
    for graphs in (False, True):
        engine = decode_engine(steps.model, device, max(steps.decode_batches), steps.kv_cache_bytes, graphs)
        if not graphs:
            result["matmuls"] = matmuls(engine, plan, rates)
        mode = "graphs" if graphs else "eager"
        result[f"profile_{mode}"] = {
            f"decode-b{batch}": profile_decode(engine, batch, steps.context, plan.num_steps)
            for batch in plan.profiled_batches
        }
        del engine
        free_device_memory()
    return result


def print_table(part: dict) -> None:
    print(
        f"{'matmuls alone':24}{'rows':>6}{'us':>10}{'TB/s':>8}{'of copy':>9}{'TFLOP/s':>9}  split-K candidate"
    )
    for m in part["matmuls"]["alone"]:
        split_k = f"  {m['split_k_us']:.1f} us ({m['split_k_config']})" if "split_k_us" in m else ""
        print(f"{m['matmul']:24}{m['rows']:>6}{m['us']:>10.1f}{m['weight_bytes_per_s'] / 1e12:>8.3f}"
              f"{m['of_measured_copy']:>9.2f}{m['flops_per_s'] / 1e12:>9.1f}{split_k}")  # fmt: skip
    for s in part["matmuls"]["step"]:
        print(f"a step's matmuls at {s['rows']} rows: {s['matmuls_ms']:.3f} ms, the weights' floor "
              f"{s['weights_floor_ms']:.3f} ms: {s['ratio']:.2f}x")  # fmt: skip
    for mode in ("eager", "graphs"):
        for case, kernels in part[f"profile_{mode}"].items():
            shares = ", ".join(f"{kind} {ms:.3f}" for kind, ms in kernels["by_category_ms"].items() if ms)
            read = ", ".join(f"{kind} {rate / 1e12:.3f}" for kind, rate in kernels["bytes_per_s"].items())
            total = kernels["kernels_ms_per_step"]
            print(f"{case} {mode}: kernels {total:.3f} ms a step ({shares}); TB/s read: {read}")
            for k in kernels["top"][:5]:
                print(f"    {k['us_per_call']:9.1f} us x {k['calls_per_step']:5.0f}  {k['kernel'][:90]}")
