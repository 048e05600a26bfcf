"""The CPU kernels of replica_engine/kernels/*.cpp (SOURCES), built on first use for this machine
(-march=native) by torch's C++ extension loader and cached in a directory named by the sources'
hash under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), so two checkouts with other
sources never rebuild over each other. Where they cannot be built (no
compiler, no AVX-512), callers fall back to torch's own ops.

One build at a time, under an flock the kernel drops if the building process dies: torch's own
lock is a file that a build killed midway (a replica stopped while it started) leaves behind,
and every later start would wait on it forever."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from replica_engine.kernels import prompt_rows
from replica_engine.kernels.quantized_weight import QuantizedWeight, dequantize, dequantize_rows

logger = logging.getLogger(__name__)
KERNEL_DIR = Path(__file__).parent
SOURCES = [
    str(KERNEL_DIR / name)
    for name in (
        "cpu_ops.cpp",
        "cpu_decode_attention.cpp",
        "cpu_pointwise.cpp",
        "cpu_prefill_attention.cpp",
        "cpu_prefill_attention_bf16.cpp",
        "cpu_packed_linear.cpp",
        "cpu_quantized_linear.cpp",
        "cpu_quantized_rows.cpp",
        "cpu_decoder_layer.cpp",
        "cpu_sampling.cpp",
    )
]
HEADERS = (
    "simd.h",
    "tensor.h",
    "cpu_pointwise.h",
    "cpu_attention.h",
    "cpu_linear.h",
    "cpu_moe.h",
    "cpu_decoder_layer.h",
    "cpu_quantized_format.h",
    "cpu_sampling.h",
    "parallel.h",
)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _headers_hash() -> str:
    return hashlib.sha256(b"".join((KERNEL_DIR / name).read_bytes() for name in HEADERS)).hexdigest()


def build_directory() -> Path:
    """Where this source tree's build lives: named by the hash of every source and header."""
    sources = b"".join(Path(source).read_bytes() for source in SOURCES)
    digest = hashlib.sha256(_headers_hash().encode() + sources).hexdigest()[:16]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return root / f"stallfree_cpu_ops-{digest}"


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled module, or None (logged once) where it cannot be had."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        logger.info(
            "CPU kernels need AVX-512 (this CPU: %s): using torch's ops",
            torch.backends.cpu.get_cpu_capability(),
        )
        return None
    try:
        from torch.utils.cpp_extension import load

        # torch rebuilds when the sources or flags change; the headers' hash, as a flag, counts too.
        headers = _headers_hash()
        build_dir = build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        with (build_dir / "stallfree.lock").open("w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)  # torch's, left by a killed build: stale
            return load(
                name="stallfree_cpu_ops",
                sources=SOURCES,
                # OpenMP only as ATen's parallel_for needs it: the process's libgomp is torch's.
                extra_cflags=[
                    "-O3",
                    "-march=native",
                    "-fopenmp",
                    f"-DSTALLFREE_HEADERS={headers[:16]}",
                ],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
            )
    except Exception as error:  # no compiler, no ninja, a failed build: torch's ops still work
        logger.warning("CPU kernels could not be built (%s): using torch's ops", error)
        return None


def _ops_for(*tensors: torch.Tensor) -> ModuleType | None:
    """The kernels, if built and every tensor is on the CPU in one kernel dtype; else None."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in KERNEL_DTYPES:
        return None
    for t in tensors:  # a loop, not any() over a generator: this runs a few hundred times a step
        if t.dtype != first.dtype or t.device.type != "cpu":
            return None
    return cpu_ops()


@dataclass(frozen=True)
class PackedWeight:
    """A linear layer's weight [out_features, K] repacked once, at load, for the packed kernel:
    16 output columns side by side per k, so every row count a step has runs as outer products
    (above torch's matmul rate on this machine at every M, and 2x its GEMV at M = 1)."""

    data: torch.Tensor
    out_features: int


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The packed copy of weight, or None where the packed kernel does not apply (another
    device or dtype, an odd K in bfloat16, no kernels): then the layer keeps torch's F.linear."""
    ops = _ops_for(weight)
    if ops is None or weight.dim() != 2 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2):
        return None
    return PackedWeight(ops.pack_linear_weight(weight.detach().contiguous()), weight.shape[0])


@dataclass(frozen=True)
class TiledWeight:
    """A kernel weight with a bfloat16 copy in torch's layout, for steps of `AMX_MIN_ROWS` rows or
    more on CPUs with AMX: there oneDNN multiplies bf16 in AMX tiles several times faster than
    our kernels (bench.engine.cpu's `amx_over_q4_kernel_by_shape`), while decode steps keep reading the
    smaller copy."""

    kernel_weight: PackedWeight | QuantizedWeight
    dense: torch.Tensor  # bfloat16 [out_features, in_features]


# Rows (tokens) of a step from which the AMX copy goes: a matmul alone is 1.1-1.3x the 4-bit
# kernel's rate at 16 rows, 1.5-1.7x at 32 (bench/results/cpu_steps.json), but a whole step
# streams the copy's 3.5x larger weights from memory (its decode-b32 step was 6% faster).
AMX_MIN_ROWS = 32


def tiled_weight(kernel_weight: PackedWeight | QuantizedWeight, weight: torch.Tensor | None) -> TiledWeight:
    """`kernel_weight` with its AMX copy: `weight` (the float weight it was packed from) in
    bfloat16, or the quantized weight dequantized (the copy multiplies the same values)."""
    if weight is None:
        assert isinstance(kernel_weight, QuantizedWeight), "a packed weight keeps its float weight"
        weight = dequantize(kernel_weight)
    return TiledWeight(kernel_weight, weight.detach().to(torch.bfloat16).contiguous())


def cpu_has_amx() -> bool:
    return torch.cpu._is_amx_tile_supported()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | PackedWeight | QuantizedWeight | TiledWeight,
    float32_out: bool = False,
) -> torch.Tensor:
    """x @ weight.T (no bias): the AMX copy of a tiled weight for a step of many rows, the packed
    kernel for a packed weight, the quantized kernel for a quantized one (or, where the kernels
    are not built, its weight dequantized for this call), torch's F.linear otherwise."""
    if isinstance(weight, TiledWeight):
        if x.shape[0] < AMX_MIN_ROWS or x.dtype != torch.bfloat16:
            weight = weight.kernel_weight
        else:
            weight = weight.dense
    if isinstance(weight, PackedWeight):
        ops = cpu_ops()
        assert ops is not None, "a weight is only packed where the kernels are built"
        return ops.packed_linear(x.contiguous(), weight.data, weight.out_features, float32_out)
    if isinstance(weight, QuantizedWeight):
        ops = _ops_for(x)
        if ops is not None:
            return _quantized_linear(ops, x.contiguous(), weight, float32_out)
        weight = dequantize(weight).to(x.dtype)
    out = F.linear(x, weight)
    return out.float() if float32_out else out


def kept_floor(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """The sampler's top-k / top-p floor per row (cpu_sampling.h) from the kernel, where it is
    built and `probs` is a float32 CPU tensor; else None."""
    ops = _ops_for(probs) if probs.dtype == torch.float32 else None
    return None if ops is None else ops.kept_floor(probs.contiguous(), top_k, top_p)


def embedding_rows(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized embedding in `dtype`: the values dequantize_rows(...).to(dtype)
    holds, from the kernel where it is built (a dozen torch ops a step cost a decode step 3%)."""
    ops = cpu_ops() if weight.codes.device.type == "cpu" and dtype in KERNEL_DTYPES else None
    if ops is None:
        return dequantize_rows(weight, ids).to(dtype)
    return ops.dequantize_rows(
        weight.codes,
        weight.scales,
        ids,
        weight.out_features,
        weight.in_features,
        weight.bits,
        weight.group,
        dtype == torch.bfloat16,
    )


def _quantized_linear(
    ops: ModuleType, x: torch.Tensor, w: QuantizedWeight, float32_out: bool
) -> torch.Tensor:
    """The int16 path, and for a step's prompt rows in bfloat16 the dense one (prompt_rows.py)."""

    def run(x: torch.Tensor, dense_from: int) -> torch.Tensor:
        return ops.quantized_linear(
            x, w.codes, w.scales, w.out_features, w.bits, w.group, float32_out, dense_from
        )

    first = dense_from(x)
    if first is not None:
        return run(x, first)
    rows = prompt_rows.current(x.shape[0])
    assert rows is not None and rows.mask is not None
    out = x.new_empty((x.shape[0], w.out_features), dtype=torch.float32 if float32_out else x.dtype)
    generated = ~rows.mask
    out[generated] = run(x[generated].contiguous(), int(generated.sum()))
    out[rows.mask] = run(x[rows.mask].contiguous(), 0)
    return out


def dense_from(x: torch.Tensor) -> int | None:
    """quantized_linear's `dense_from` for a step's activations x: the row its prompt rows start
    from, or x's row count where they take no dense path (none in the step, not bfloat16, a CPU
    without bf16 dot products); None where prompt rows and generated ones interleave (a mask)."""
    rows = prompt_rows.current(x.shape[0]) if x.dtype == torch.bfloat16 and _has_bf16_dot() else None
    return x.shape[0] if rows is None else rows.first


@functools.cache
def _has_bf16_dot() -> bool:
    """Whether this CPU multiplies bfloat16 pairs natively (AVX512-BF16), where the dense path pays."""
    return torch.cpu._is_avx512_bf16_supported()


def pack_stacked(weights: torch.Tensor) -> torch.Tensor | None:
    """Stacked weights [E, N, K] (a mixture's experts) packed each as pack_weight does, stacked
    again: [E, ...] for packed_moe; None where the packed kernel does not apply."""
    packed = [pack_weight(weight) for weight in weights]
    if any(p is None for p in packed):
        return None
    return torch.stack([p.data for p in packed])  # type: ignore[union-attr]


def packed_moe(
    x: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first: int,
    width: int,
) -> torch.Tensor:
    """A mixture's experts in one call (cpu_packed_linear.cpp's packed_moe): each token's top-k
    experts (ids from `first` are this worker's), over weights stacked by pack_stacked."""
    ops = cpu_ops()
    assert ops is not None, "weights are only packed where the kernels are built"
    ids, weights = top_ids.contiguous(), top_weights.float().contiguous()
    return ops.packed_moe(x.contiguous(), ids, weights, gate_up, down, first, width)


def quantized_moe(
    x: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up: QuantizedWeight,
    down: QuantizedWeight,
    first: int,
    width: int,
) -> torch.Tensor | None:
    """packed_moe over quantized experts (stacked by quantized_weight.stack_quantized); None where
    the kernel does not apply (no kernels, a dtype or width it lacks): go expert by expert."""
    ops = _ops_for(x)
    if ops is None or width % 32 or x.shape[1] % 32:
        return None
    ids, weights = top_ids.contiguous(), top_weights.float().contiguous()
    g, d = gate_up, down
    return ops.quantized_moe(
        x.contiguous(), ids, weights, g.codes, g.scales, g.bits, g.group, d.codes, d.scales, d.bits, d.group,
        first, width,
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of x + residual, x + residual), or of x alone when there is no residual: the
    residual stream's add fused into the norm (the residual is updated in place)."""
    ops = _ops_for(x, weight) if x.dim() == 2 and x.shape[-1] % 16 == 0 else None
    if ops is not None and x.is_contiguous():
        return ops.rms_norm(x, weight, eps, residual), x if residual is None else residual
    summed = x if residual is None else residual.add_(x)
    # As Hugging Face's LlamaRMSNorm: normalise in float32, back to the dtype, then the weight.
    return weight * F.rms_norm(summed.float(), weight.shape, eps=eps).to(x.dtype), summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    ops = _ops_for(gate_up) if gate_up.dim() == 2 and gate_up.shape[-1] % 32 == 0 else None
    if ops is not None and gate_up.is_contiguous():
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate q [T, H, d] and k [T, KVH, d] in place by cos and sin ([T, 1, d]) where the kernel
    applies; False (nothing done) where it does not."""
    ops = _ops_for(q, k, cos, sin) if q.dim() == 3 and q.shape[-1] % 32 == 0 else None
    if ops is None or q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    ops.rotary_(q, k, cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1))
    return True


def rotary_store_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """rotary_, then k (rotated) and v ([T, KVH, d]) stored into their tokens' slots of the caches
    ([blocks, block_size, KVH, d]), in one call where the kernel applies; False (nothing done)
    where it does not."""
    ops = _ops_for(q, k, v, cos, sin, k_cache, v_cache) if q.dim() == 3 and q.shape[-1] % 32 == 0 else None
    if ops is None or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or slot_mapping.dtype != torch.int64:
        return False
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    ops.rotary_store_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping.contiguous())
    return True
