"""This machine's floors, measured in the same run as what is held against them: the best rate
it shows, each measured several ways, because one method can understate it (the host is shared,
and a plain sum, a copy and a weight-streaming GEMV do not reach the same bandwidth).

- Bytes per second: summing a 512 MiB tensor (read); copying it (read + write: both counted);
  a GEMV over a weight matrix far larger than the caches, in each dtype, through torch's linear
  and through the engine's own CPU kernel where it builds (the read pattern of a decode step).
- Matmul rate per dtype: square sizes 1024/2048/4096 and the shapes a SmolLM2 step runs (256
  and 512 rows against its projections and its logits). For weights kept quantized (issue 39),
  the quantized kernel's rate (int16 activations against 4- and 8-bit codes) on the step shapes,
  the one method this machine has for it (torch has no CPU matmul of this kind).
Each method is the best of `repeats` runs; each floor is the best method."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from replica_engine.kernels import cpu as cpu_kernels
from replica_engine.kernels.quantized_weight import QuantizedWeight, dequantize, pack_quantized

DTYPES = ("float32", "bfloat16")
SQUARE_SIZES = (1024, 2048, 4096)
# (rows, in, out): SmolLM2-135M's fused qkv, gate_up, down and logits at prompt-chunk sizes.
STEP_SHAPES = tuple(
    (rows, k, n) for rows in (256, 512) for k, n in ((576, 960), (576, 3072), (1536, 576), (576, 49152))
)
GEMV_WEIGHT_BYTES = 256 << 20  # far past every cache level


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def bandwidths(repeats: int) -> dict[str, float]:
    """GB/s by method."""
    data = torch.randn(128 << 20)  # 512 MiB of float32
    target = torch.empty_like(data)
    num_bytes = data.numel() * data.element_size()
    rates = {
        "sum": num_bytes / best_time(data.sum, repeats),
        "copy_read_write": 2 * num_bytes / best_time(lambda: target.copy_(data), repeats),
    }
    for dtype in DTYPES:
        torch_dtype = getattr(torch, dtype)
        in_features = 4096
        weight = torch.randn(GEMV_WEIGHT_BYTES // torch_dtype.itemsize // in_features, in_features)
        weight = weight.to(torch_dtype)
        x = torch.randn(1, in_features).to(torch_dtype)
        weight_bytes = weight.numel() * weight.element_size()
        rates[f"gemv_torch_{dtype}"] = weight_bytes / best_time(
            lambda w=weight, x=x: torch.nn.functional.linear(x, w), repeats
        )
        packed = cpu_kernels.pack_weight(weight)
        if packed is not None:
            rates[f"gemv_engine_kernel_{dtype}"] = weight_bytes / best_time(
                lambda w=packed, x=x: cpu_kernels.linear(x, w), repeats
            )
    if cpu_kernels.cpu_ops() is not None:  # 4-bit codes: each byte holds two weights
        quantized, x = random_quantized(2 * GEMV_WEIGHT_BYTES // 4096, 4096, 4), torch.randn(1, 4096)
        rates["gemv_engine_kernel_q4"] = quantized.nbytes / best_time(
            lambda: cpu_kernels.linear(x, quantized), repeats
        )
    return {method: rate / 1e9 for method, rate in rates.items()}


def random_quantized(n: int, k: int, bits: int) -> QuantizedWeight:
    """Random codes of `bits` in groups of 32, with scales: what the quantized kernel reads."""
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    d, m = torch.rand(n, k // 32) * 0.01, -torch.rand(n, k // 32) * 0.05
    return pack_quantized(codes, d, m, bits, 32)


def matmul_rates(dtype: str, repeats: int) -> dict[str, float]:
    """GFLOP/s by shape."""
    torch_dtype = getattr(torch, dtype)
    shapes = [(size, size, size) for size in SQUARE_SIZES] + list(STEP_SHAPES)
    rates = {}
    for rows, k, n in shapes:
        a = torch.randn(rows, k).to(torch_dtype)
        b = torch.randn(n, k).to(torch_dtype)  # as a linear layer's weight
        seconds = best_time(lambda a=a, b=b: torch.nn.functional.linear(a, b), repeats)
        rates[f"{rows}x{k}x{n}"] = 2 * rows * k * n / seconds / 1e9
        packed = cpu_kernels.pack_weight(b)  # the engine's own kernel counts too: the best is the floor
        if packed is not None:
            seconds = best_time(lambda a=a, b=packed: cpu_kernels.linear(a, b), repeats)
            rates[f"{rows}x{k}x{n}_engine_kernel"] = 2 * rows * k * n / seconds / 1e9
    return rates


def quantized_matmul_rates(repeats: int) -> dict[str, float]:
    """GOP/s by shape and code width: int16 activations against quantized weights."""
    rates = {}
    for rows, k, n in STEP_SHAPES:
        x = torch.randn(rows, k).to(torch.bfloat16)
        for bits in (4, 8):
            weight = random_quantized(n, k, bits)
            seconds = best_time(lambda x=x, w=weight: cpu_kernels.linear(x, w), repeats)
            rates[f"{rows}x{k}x{n}_q{bits}"] = 2 * rows * k * n / seconds / 1e9
    return rates


# Rows of a step about the AMX copy's threshold (replica_engine/kernels/cpu.py AMX_MIN_ROWS).
CROSSOVER_ROWS = (1, 8, 16, 32, 64, 128, 256)


def amx_over_kernel(repeats: int) -> dict[str, float]:
    """By step shape: how many times faster torch multiplies a 4-bit weight's bfloat16 copy
    (oneDNN: AMX tiles where the CPU has them) than the quantized kernel multiplies its codes,
    on SmolLM2's gate_up and down projections at rows about the threshold."""
    ratios = {}
    for k, n in ((576, 3072), (1536, 576)):
        weight = random_quantized(n, k, 4)
        copy = dequantize(weight).to(torch.bfloat16)
        for rows in CROSSOVER_ROWS:
            x = torch.randn(rows, k).to(torch.bfloat16)
            kernel_s = best_time(lambda x=x, w=weight: cpu_kernels.linear(x, w), repeats)
            tiles_s = best_time(lambda x=x, w=copy: torch.nn.functional.linear(x, w), repeats)
            ratios[f"{rows}x{k}x{n}"] = kernel_s / tiles_s
    return ratios


def measure_floors(repeats: int = 10) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The floors (the best of each kind) and every method's figure behind them."""
    methods = {"read_gb_per_s": bandwidths(repeats)}
    for dtype in DTYPES:
        methods[f"matmul_{dtype}_gflop_per_s"] = matmul_rates(dtype, repeats)
    if cpu_kernels.cpu_ops() is not None:
        methods["matmul_quantized_gop_per_s"] = quantized_matmul_rates(repeats)
    return {kind: max(by_method.values()) for kind, by_method in methods.items()}, methods
