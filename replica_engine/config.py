"""Engine settings, validated up front; `resolve` fills device-dependent defaults."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from common.errors import InvalidRequestError
from common.model_source import DEFAULT_MODEL, context_length
from replica_engine.attention import ATTENTION_BACKENDS
from replica_engine.kernels.cpu import cpu_ops
from replica_engine.scheduler import SCHEDULING_POLICIES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_BACKEND_NAMES = ("auto", *ATTENTION_BACKENDS)
GiB = 1 << 30

# Defaults per device. Serving keeps steps short so time between tokens stays low; offline
# (the LLM class) wants throughput, and a bigger budget means fewer passes over the weights
# (vLLM's usage-context defaults make the same split).
_CPU_DEFAULTS = {
    # SmolLM2 in bf16 on 2 cores: a 256-token chunk step takes ~0.25 s; 512 doubled the TBT
    # p99 under load for 3% more throughput (bench.cpu_serving).
    "max_num_batched_tokens": 256,
    "offline_max_num_batched_tokens": 2048,
    "max_num_seqs": 64,
    "kv_cache_bytes": GiB,
}
_GPU_DEFAULTS = {"max_num_batched_tokens": 2048, "offline_max_num_batched_tokens": 8192, "max_num_seqs": 256}


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 dot products or AMX tiles: what oneDNN and our kernels multiply bf16 with."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def _positive_int(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidRequestError(name, f"must be a positive integer, got {value!r}")


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL  # embedded SmolLM2, a HF directory, a .gguf file, or dummy:<shape>
    device: str = "auto"  # cuda when available, else cpu
    dtype: str = "auto"  # bfloat16 on cuda and on CPUs that multiply it natively, else float32
    max_num_batched_tokens: int | None = None  # the per-step token budget (with tbt_slo_s: its cap)
    tbt_slo_s: float | None = None  # time-between-tokens target: prompt chunks sized to keep steps within it
    max_num_seqs: int | None = None  # most requests running at once
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int | None = None  # KV pool size; on GPU, overrides gpu_memory_utilization
    num_kv_blocks: int | None = (
        None  # KV blocks requests may hold; overrides both (vLLM's num_gpu_blocks_override)
    )
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may use in all
    max_model_len: int | None = None  # prompt + output cap; default: the model's context
    attention_backend: str = "auto"
    scheduling_policy: str = "stall_free"  # or prefill_first, static (benchmark baselines)
    enable_prefix_caching: bool = True  # reuse the K/V of prompt prefixes already computed
    # Requests' priorities must lie in [-max_priority, max_priority] (lower is served first);
    # others are refused naming `priority`. None: any integer, as vLLM.
    max_priority: int | None = None
    seed: int = 0  # for dummy weights and unseeded sampling
    offline: bool = False  # set by LLM: throughput over latency when choosing defaults

    def __post_init__(self) -> None:
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "block_size",
            "kv_cache_bytes",
            "num_kv_blocks",
            "max_model_len",
        ):
            _positive_int(name, getattr(self, name))
        if self.tbt_slo_s is not None:
            number = isinstance(self.tbt_slo_s, int | float) and not isinstance(self.tbt_slo_s, bool)
            if not number or not math.isfinite(self.tbt_slo_s) or self.tbt_slo_s <= 0:
                raise InvalidRequestError(
                    "tbt_slo_s", f"must be a positive number of seconds, got {self.tbt_slo_s!r}"
                )
            if self.scheduling_policy != "stall_free":
                raise InvalidRequestError(
                    "tbt_slo_s",
                    f"sizes stall_free's prompt chunks; scheduling_policy is {self.scheduling_policy!r}",
                )
        bound = self.max_priority
        if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
            raise InvalidRequestError("max_priority", f"must be an integer >= 0 or None, got {bound!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidRequestError(
                "enable_prefix_caching", f"must be true or false, got {self.enable_prefix_caching!r}"
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(
                "dtype", f"must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}"
            )
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            raise InvalidRequestError(
                "attention_backend",
                f"must be one of {ATTENTION_BACKEND_NAMES}, got {self.attention_backend!r}",
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidRequestError(
                "scheduling_policy",
                f"must be one of {sorted(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}",
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as error:
                raise InvalidRequestError("device", str(error)) from None

    def resolve(self, model_config: PretrainedConfig) -> EngineConfig:
        """A copy with every default made concrete for this machine and model."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        on_gpu = torch.device(device).type == "cuda"
        if on_gpu and not torch.cuda.is_available():
            raise InvalidRequestError("device", f"{device!r} asked for, but CUDA is not available")
        defaults = _GPU_DEFAULTS if on_gpu else _CPU_DEFAULTS
        model_max_len = context_length(model_config.to_dict())
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise InvalidRequestError(
                "max_model_len", f"{self.max_model_len} exceeds the model's context of {model_max_len} tokens"
            )
        return dataclasses.replace(
            self,
            device=device,
            dtype=self._dtype(on_gpu),
            max_num_batched_tokens=self.max_num_batched_tokens
            or defaults["offline_max_num_batched_tokens" if self.offline else "max_num_batched_tokens"],
            max_num_seqs=self.max_num_seqs or defaults["max_num_seqs"],
            kv_cache_bytes=self.kv_cache_bytes or defaults.get("kv_cache_bytes"),
            max_model_len=self.max_model_len or model_max_len,
            attention_backend=self._attention_backend(on_gpu),
        )

    def _dtype(self, on_gpu: bool) -> str:
        """auto: bf16 where the hardware multiplies it natively (half the bytes per decode step,
        twice the matmul rate); fp32 on CPUs that would emulate bf16 arithmetic."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if on_gpu or cpu_has_native_bf16() else "float32"

    def _attention_backend(self, on_gpu: bool) -> str:
        """auto: our Triton kernels on a GPU (when triton imports); on a CPU our CPU kernels where
        they build (AVX-512, a C++ compiler); else the torch reference."""
        if self.attention_backend != "auto":
            return self.attention_backend
        if on_gpu:
            return "triton" if importlib.util.find_spec("triton") is not None else "torch"
        return "cpu" if cpu_ops() is not None else "torch"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
