"""The CPU kernels of cpu_ops.cpp, built on first use for this machine (-march=native) by torch's
C++ extension loader and cached by it (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions).
Where they cannot be built (no compiler, no AVX-512), callers fall back to torch's own ops."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_ops.cpp")
# Up to this many rows, a linear layer is a few matrix-vector products: memory-bound, where our
# kernel streams the weights faster than torch's (MKL/oneDNN) small-M paths on this hardware.
SMALL_M = 16
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


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

        return load(
            name="stallfree_cpu_ops",
            sources=[str(SOURCE)],
            # OpenMP only as ATen's parallel_for needs it: the process's libgomp is torch's.
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # no compiler, no ninja, a failed build: torch's ops still work
        logger.warning("CPU kernels could not be built (%s): using torch's ops", error)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, float32_out: bool = False) -> torch.Tensor:
    """x @ weight.T (no bias); our kernel for a few rows on the CPU, torch's otherwise."""
    if (
        x.device.type == "cpu"
        and x.shape[0] <= SMALL_M
        and x.dtype in KERNEL_DTYPES
        and x.dtype == weight.dtype
    ):
        ops = cpu_ops()
        if ops is not None:
            return ops.linear(x.contiguous(), weight, float32_out)
    out = F.linear(x, weight)
    return out.float() if float32_out else out
