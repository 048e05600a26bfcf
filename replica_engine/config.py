"""Engine settings, validated up front; `resolve` fills device-dependent defaults."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from common.errors import InvalidRequestError
from common.model_source import DEFAULT_MODEL, context_length, gguf_file
from replica_engine.attention import ATTENTION_BACKENDS
from replica_engine.kernels.cpu import cpu_has_amx, cpu_ops
from replica_engine.parallel.pipeline_parallel import check_layers
from replica_engine.parallel.tensor_parallel import check_divisible
from replica_engine.pooling import POOLING_TYPES
from replica_engine.scheduler import SCHEDULING_POLICIES
from replica_engine.spec_decode.config import FIELD, SpeculativeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_BACKEND_NAMES = ("auto", *ATTENTION_BACKENDS)
QUANTIZATIONS = ("auto", "none", "gguf", "int8")
EXECUTOR_BACKENDS = ("mp", "ray")  # parallel workers: processes of the replica, or Ray actors
GiB = 1 << 30

# Defaults per device. Serving keeps steps short so time between tokens stays low; offline
# (the LLM class) wants throughput, and a bigger budget means fewer passes over the weights
# (vLLM's usage-context defaults make the same split).
CPU_DEFAULTS = {
    # SmolLM2 in bf16 on 2 cores: a 256-token chunk step takes ~0.25 s; 512 doubled the TBT
    # p99 under load for 3% more throughput (bench.serving.cpu_serving).
    "max_num_batched_tokens": 256,
    "offline_max_num_batched_tokens": 2048,
    "max_num_seqs": 64,
    "kv_cache_bytes": GiB,
}
GPU_DEFAULTS = {"max_num_batched_tokens": 2048, "offline_max_num_batched_tokens": 8192, "max_num_seqs": 256}


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 dot products or AMX tiles: what oneDNN and our kernels multiply bf16 with."""
    return torch.cpu._is_avx512_bf16_supported() or cpu_has_amx()


def _positive_int(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidRequestError(name, f"must be a positive integer, got {value!r}")


def _doc(text: str) -> dict[str, str]:
    """A field's description, read by the docs' generated settings table (docs/configuration.md)."""
    return {"doc": text}


@dataclass
class EngineConfig:
    """Keyword arguments of `LLM(...)`, and a deployment's `engine:` settings (all but `model`
    and `offline`). `None` defaults are filled per device by `resolve` (CPU_DEFAULTS,
    GPU_DEFAULTS)."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata=_doc(
            "What to load: the embedded SmolLM2-135M-Instruct, a local Hugging Face directory, a "
            "`.gguf` file, or `dummy:<shape>` (random weights of a real shape, for benchmarks)"
        ),
    )
    device: str = field(default="auto", metadata=_doc("`auto`: `cuda` when available, else `cpu`"))
    dtype: str = field(
        default="auto",
        metadata=_doc(
            "`auto`: bfloat16 on GPU and on CPUs that multiply it natively (AVX512-BF16 or AMX), "
            "else float32. `float32` is what the exactness tests run (greedy output equals "
            "transformers'); `bfloat16` halves the bytes a decode step reads (what it changes in "
            "outputs: `python -m bench dtype_agreement`); `float16`"
        ),
    )
    quantization: str = field(
        default="auto",
        metadata=_doc(
            "How linear weights are held on a CPU. `gguf`: a GGUF model's quantized blocks as they "
            "are in the file (Q4_0, Q4_1, Q4_K, Q8_0, Q6_K; other types stay dequantized), "
            "multiplied by activations held as int16 (in bfloat16 on a CPU with AVX512-BF16, a "
            "prompt's tokens meet them dequantized to bfloat16); `int8`: any model's weights as "
            "int8 with one scale per output channel; `none`: float weights in `dtype`. `auto`: "
            "`gguf` for a GGUF model "
            "(the embedded default included) where the CPU kernels build, else `none`. A GPU "
            "takes `none` only (no GPU kernel yet); `gguf` is not yet split over "
            "`tensor_parallel_size`"
        ),
    )
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_doc(
            "The token budget of one step: decodes first, then prompt chunks (with `tbt_slo_s`: "
            "its cap). Offline runs favour throughput (fewer, larger steps); serving favours the "
            "time between tokens"
        ),
    )
    tbt_slo_s: float | None = field(
        default=None,
        metadata=_doc(
            "A time-between-tokens target in seconds (`stall_free` only): each step's prompt "
            "chunks are sized so its predicted time stays within 0.9x of it, and "
            "`max_num_batched_tokens` becomes the cap. Unset: the fixed budget"
        ),
    )
    max_num_seqs: int | None = field(default=None, metadata=_doc("Most requests holding KV cache at once"))
    block_size: int = field(default=16, metadata=_doc("Tokens per KV cache block"))
    kv_cache_bytes: int | None = field(
        default=None,
        metadata=_doc("Size of the KV pool in bytes; on GPU it overrides `gpu_memory_utilization`"),
    )
    num_kv_blocks: int | None = field(
        default=None,
        metadata=_doc(
            "KV blocks requests may hold; overrides both settings above (vLLM's "
            "`num_gpu_blocks_override`). One more block is allocated: block 0, the null block "
            "that pads block tables. Default: from `kv_cache_bytes`"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=_doc("GPU: the share of its memory for weights, activations and the KV pool")
    )
    max_model_len: int | None = field(
        default=None, metadata=_doc("Most prompt + output tokens per request. Default: the model's context")
    )
    attention_backend: str = field(
        default="auto",
        metadata=_doc(
            "`auto`: `triton` on GPU; on CPU `cpu` where our CPU kernels build, else `torch`. "
            "`triton`: one kernel launch per layer for a mixed batch of prompt chunks and decodes "
            "over the paged cache; `cpu`: our C++ kernels reading the paged cache in place; "
            "`torch`: the reference (gather + SDPA)"
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_doc(
            "Workers one replica's model is split over (Megatron-style: heads, MLP width and "
            "vocabulary divided among them), each a process of its own; gloo on a CPU, NCCL on "
            "a GPU. Must divide the model's query and KV heads, MLP width and vocabulary"
        ),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=_doc(
            "Stages one replica's layers are split over, each a worker process of its own "
            "passing the hidden states on; as many batches in the pipeline at once as there are "
            "stages (a request in one sits out scheduling until its token is known). Not yet "
            "combined with `tensor_parallel_size`"
        ),
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata=_doc(
            "For a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE): the "
            "`tensor_parallel_size` workers split the experts among them, each holding whole "
            "experts, instead of a slice of every expert's width (attention stays split by "
            "heads). Must divide the number of experts; refused for a dense model"
        ),
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata=_doc(
            "Where parallel workers run: `mp`, child processes of the replica on its node; `ray`, "
            "Ray actors in the bundles of the replica's placement group after its own (any node: "
            "the app's `placement_strategy`), or in a group of their own in a plain Ray driver. "
            "`ray` needs `core_process: false` (the executor calls Ray from the replica's process)"
        ),
    )
    cuda_graphs: bool | None = field(
        default=None,
        metadata=_doc(
            "Decode-only steps replay CUDA graphs captured at start, one per padded batch size "
            "(needs the `triton` backend). Unset: on for a GPU with the `triton` backend (on an "
            "H200, bench.gpu's offline run was 1.3x faster with them, with the same tokens), "
            "off on a CPU. `true` on a CPU runs the same padded batches eagerly (what the tests check)"
        ),
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata=_doc(
            "Schedule and prepare step N+1 while step N runs (vLLM's async scheduling): the tokens "
            "N samples stay on the device, N+1 reads them there, and the host learns them a step "
            "later, so the GPU does not wait for the host between steps. Same tokens as synchronous "
            "steps. Steps go one at a time while a structured-output request runs or the KV pool "
            "is short (then preemption decides as without it). Unset: on for a GPU replica of one "
            "worker, off on a CPU (where the step computes on the host anyway, and a token would "
            "reach the client a step later). Not with tensor or pipeline parallelism"
        ),
    )
    speculative_config: dict | None = field(
        default=None,
        metadata=_doc(
            "Speculative decoding, by vLLM's names: `{method: ngram, num_speculative_tokens: k, "
            "prompt_lookup_min, prompt_lookup_max}` or `{method: suffix, suffix_decoding_max_tree_depth, "
            "suffix_decoding_max_cached_requests, suffix_decoding_max_spec_factor, "
            "suffix_decoding_min_token_prob}` or `{method: draft_model, model, num_speculative_tokens}`. "
            "Prompt lookup proposes up to k tokens a step from the "
            "request's own text (what followed the latest earlier occurrence of its last 1-5 tokens); "
            "suffix decoding what most earlier occurrences of its longest matching suffix went on "
            "with, in its own text and in earlier requests' outputs; a draft model (the target's "
            "vocabulary) its greedy tokens. The model checks them in the "
            "same step, as far as the step-time model says they pay: greedy and seeded outputs are "
            "the same tokens, sampled ones the same distribution. Requests with structured outputs, "
            "penalties, logit bias, logprobs or min_tokens still to reach decode one token a step. "
            "Steps go one at a time (no async scheduling); not yet with tensor or pipeline parallelism"
        ),
    )
    amx_weights: bool = field(
        default=False,
        metadata=_doc(
            "A bfloat16 copy of every linear weight beside the one our CPU kernels read (packed or "
            "quantized), for steps of 32 tokens or more on CPUs with AMX: oneDNN multiplies it in "
            "AMX tiles several times faster than our kernels do, so prompt chunks compute sooner, "
            "while decode steps keep reading the smaller copy. Costs 2 bytes a parameter (0.21 GB for "
            "SmolLM2-135M, 14 GB for an 8B model). Off by default: the copy is not the kernels' "
            "weight to the bit (a 4-bit block's values rounded to bfloat16) and oneDNN sums in "
            "another order, so a token's logits then depend on how many tokens its step computes "
            "(a prefix-cache hit, a chunk boundary, the batch): the same greedy request can answer "
            "with other logprobs, or another token at a near-tie. Without it a token's logits are "
            "the same whatever its step holds. Needs a bfloat16 model on a CPU"
        ),
    )
    scheduling_policy: str = field(
        default="stall_free",
        metadata=_doc(
            "`stall_free` (Sarathi-Serve's chunked prefill); `prefill_first` (Orca/vLLM v0) and "
            "`static` (request-level batching) are benchmark baselines"
        ),
    )
    disable_any_whitespace: bool = field(
        default=True,
        metadata=_doc(
            "Structured outputs: JSON without free whitespace (compact, one space after `:` and "
            "`,`), vLLM's `disable_any_whitespace`. `false`: whitespace is the model's choice, vLLM's "
            "default; SmolLM2 parsed fewer outputs so (`python -m bench structured_quality`). A "
            "request may ask for either in `structured_outputs.disable_any_whitespace`"
        ),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_doc("Reuse the K/V of prompt prefixes the engine has already computed")
    )
    max_priority: int | None = field(
        default=None,
        metadata=_doc(
            "Requests' `priority` must lie in [-max_priority, max_priority] (lower is served "
            "first); others are refused naming `priority`. None: any integer, as vLLM"
        ),
    )
    pooling: str = field(
        default="last",
        metadata=_doc(
            "Embeddings (`/v1/embeddings`, `LLM.embed`): `last`, the final hidden state of the "
            "prompt's last token (vLLM's default for decoder models), or `mean`, the average over "
            "every prompt token (such requests skip the prefix cache: every token's state is summed)"
        ),
    )
    normalize_embeddings: bool = field(
        default=True, metadata=_doc("Embeddings are scaled to unit L2 length, as OpenAI's are")
    )
    enable_lora: bool = field(
        default=False,
        metadata=_doc(
            "Serve LoRA adapters (PEFT format) on this replica: a step mixes rows of different "
            "adapters and of the base model, each adapter's delta applied to its own rows. The app "
            "turns it on when `lora_modules` or `lora_root` is set. Not yet with tensor or pipeline "
            "parallelism"
        ),
    )
    max_loras: int = field(
        default=4,
        metadata=_doc(
            "LoRA: adapters running at once (each holds a slot of device memory); a request whose "
            "adapter would make one more waits until one drains"
        ),
    )
    max_lora_rank: int = field(default=16, metadata=_doc("LoRA: the highest adapter rank accepted"))
    max_cpu_loras: int | None = field(
        default=None,
        metadata=_doc(
            "LoRA: adapters kept loaded in host memory, least recently used evicted. Default: `max_loras`"
        ),
    )
    seed: int = field(default=0, metadata=_doc("Seeds dummy weights and unseeded sampling"))
    core_process: bool | None = field(
        default=None,
        metadata=_doc(
            "Serving: run the engine core (scheduler, KV cache, model) in a process of its own, as"
            " vLLM v1 does, so the replica's event loop and Ray never hold its interpreter; false"
            " runs it on a thread of the replica's process. Default: its own process on a GPU"
            " replica of one worker (the core's host work and the streaming share no interpreter),"
            " a thread on a CPU (where the model's threads take the cores anyway). The offline"
            " `LLM` always runs it in place"
        ),
    )
    offline: bool = field(
        default=False,
        metadata=_doc(
            "Set by `LLM`: throughput over latency when choosing the defaults (not a serve setting)"
        ),
    )

    def __post_init__(self) -> None:
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "block_size",
            "kv_cache_bytes",
            "num_kv_blocks",
            "max_model_len",
            "max_loras",
            "max_lora_rank",
            "max_cpu_loras",
        ):
            _positive_int(name, getattr(self, name))
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidRequestError("max_cpu_loras", f"must be at least max_loras ({self.max_loras})")
        if self.enable_lora and self.num_workers > 1:
            raise InvalidRequestError(
                "enable_lora", "LoRA is not yet served with tensor or pipeline parallelism"
            )
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
        for flag in (
            "enable_prefix_caching",
            "normalize_embeddings",
            "enable_lora",
            "amx_weights",
        ):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidRequestError(flag, f"must be true or false, got {getattr(self, flag)!r}")
        for flag in ("cuda_graphs", "async_scheduling", "core_process"):
            if getattr(self, flag) is not None and not isinstance(getattr(self, flag), bool):
                raise InvalidRequestError(flag, f"must be true, false or unset, got {getattr(self, flag)!r}")
        if self.async_scheduling and self.num_workers > 1:
            raise InvalidRequestError(
                "async_scheduling",
                "not yet with tensor or pipeline parallelism (the workers take the tokens)",
            )
        self._check_speculative()
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise InvalidRequestError(
                "distributed_executor_backend",
                f"must be one of {EXECUTOR_BACKENDS}, got {self.distributed_executor_backend!r}",
            )
        if self.distributed_executor_backend == "ray" and self.core_process:
            raise InvalidRequestError(
                "distributed_executor_backend",
                "ray needs core_process: false (Ray's API is the replica's process's, not the core's)",
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(
                "dtype", f"must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(
                "quantization", f"must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        self._check_quantization_device(on_gpu=self.device.startswith("cuda"))
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            raise InvalidRequestError(
                "attention_backend",
                f"must be one of {ATTENTION_BACKEND_NAMES}, got {self.attention_backend!r}",
            )
        if self.pooling not in POOLING_TYPES:
            raise InvalidRequestError("pooling", f"must be one of {POOLING_TYPES}, got {self.pooling!r}")
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

    @property
    def speculative(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_settings(self.speculative_config)

    def _check_speculative(self) -> None:
        if self.speculative is None:
            return
        if self.async_scheduling:
            raise InvalidRequestError(
                "async_scheduling",
                "not with speculative_config (how many tokens a step keeps decides the next)",
            )
        if self.num_workers > 1:
            raise InvalidRequestError(FIELD, "not yet with tensor or pipeline parallelism")

    def resolve(self, model_config: PretrainedConfig) -> EngineConfig:
        """A copy with every default made concrete for this machine and model."""
        device = self._device()
        on_gpu = torch.device(device).type == "cuda"
        if on_gpu and not torch.cuda.is_available():
            raise InvalidRequestError("device", f"{device!r} asked for, but CUDA is not available")
        defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
        self.check_parallel(model_config)
        model_max_len = context_length(model_config.to_dict())
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise InvalidRequestError(
                "max_model_len", f"{self.max_model_len} exceeds the model's context of {model_max_len} tokens"
            )
        attention_backend = self._attention_backend(on_gpu)
        if self.cuda_graphs and attention_backend != "triton":
            raise InvalidRequestError(
                "cuda_graphs",
                f"needs attention_backend 'triton' (the only one captured), got {attention_backend!r}",
            )
        return dataclasses.replace(
            self,
            device=device,
            dtype=self._dtype(on_gpu),
            quantization=self._quantization(on_gpu),
            max_num_batched_tokens=self.max_num_batched_tokens
            or defaults["offline_max_num_batched_tokens" if self.offline else "max_num_batched_tokens"],
            max_num_seqs=self.max_num_seqs or defaults["max_num_seqs"],
            kv_cache_bytes=self.kv_cache_bytes or defaults.get("kv_cache_bytes"),
            max_model_len=self.max_model_len or model_max_len,
            max_cpu_loras=self.max_cpu_loras or self.max_loras,
            attention_backend=attention_backend,
            cuda_graphs=self.cuda_graphs
            if self.cuda_graphs is not None
            else on_gpu and attention_backend == "triton" and self.pipeline_parallel_size == 1,
            async_scheduling=self.async_scheduling
            if self.async_scheduling is not None
            else on_gpu and self.num_workers == 1 and self.speculative is None,
            amx_weights=self._amx_weights(on_gpu),
            core_process=self.runs_core_in_process,
        )

    def _amx_weights(self, on_gpu: bool) -> bool:
        dtype = self._dtype(on_gpu)
        if self.amx_weights and (on_gpu or dtype != "bfloat16"):
            raise InvalidRequestError(
                "amx_weights",
                f"needs a bfloat16 model on a CPU, got {dtype} on {'a GPU' if on_gpu else 'a CPU'}",
            )
        return self.amx_weights

    def _dtype(self, on_gpu: bool) -> str:
        """auto: bf16 where the hardware multiplies it natively (half the bytes per decode step,
        twice the matmul rate); fp32 on CPUs that would emulate bf16 arithmetic."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if on_gpu or cpu_has_native_bf16() else "float32"

    def _check_quantization_device(self, on_gpu: bool) -> None:
        if on_gpu and self.quantization in ("gguf", "int8"):
            raise InvalidRequestError(
                "quantization", f"{self.quantization!r} has no GPU kernel yet: use 'none' on a GPU"
            )

    def _quantization(self, on_gpu: bool) -> str:
        """auto: a GGUF model's own blocks where the CPU kernels build; explicit settings are
        checked against the device, the model and the parallel layout."""
        from_gguf = gguf_file(self.model) is not None
        if self.quantization == "auto":
            native = from_gguf and not on_gpu and self.tensor_parallel_size == 1 and cpu_ops() is not None
            return "gguf" if native else "none"
        self._check_quantization_device(on_gpu)  # again: device auto may have found a GPU
        if self.quantization == "gguf" and not from_gguf:
            raise InvalidRequestError("quantization", f"'gguf' needs a .gguf model, got {self.model!r}")
        if self.quantization == "gguf" and self.tensor_parallel_size > 1:
            raise InvalidRequestError(
                "quantization", "'gguf' is not yet split over tensor_parallel_size > 1: use 'int8' or 'none'"
            )
        return self.quantization

    def _attention_backend(self, on_gpu: bool) -> str:
        """auto: our Triton kernels on a GPU (when triton imports); on a CPU our CPU kernels where
        they build (AVX-512, a C++ compiler); else the torch reference."""
        if self.attention_backend != "auto":
            return self.attention_backend
        if on_gpu:
            return "triton" if importlib.util.find_spec("triton") is not None else "torch"
        return "cpu" if cpu_ops() is not None else "torch"

    def check_parallel(self, model_config: PretrainedConfig) -> None:
        """The parallel layout against the model's shape (also at deploy time, on any node)."""
        check_divisible(model_config, self.tensor_parallel_size, self.enable_expert_parallel)
        check_layers(model_config, self.pipeline_parallel_size)
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise InvalidRequestError(
                "pipeline_parallel_size", "not yet combined with tensor_parallel_size above 1"
            )
        if self.cuda_graphs and self.pipeline_parallel_size > 1:
            raise InvalidRequestError("cuda_graphs", "not captured across pipeline stages")

    @property
    def num_workers(self) -> int:
        """Model worker processes: 1 means the model runs in the engine core's own process."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def runs_core_in_process(self) -> bool:
        """core_process, or where unset: a process of its own on a GPU replica of one worker."""
        if self.core_process is not None:
            return self.core_process
        on_gpu = torch.device(self._device()).type == "cuda"
        return on_gpu and self.num_workers == 1 and self.distributed_executor_backend == "mp"

    def _device(self) -> str:
        """`device`, `auto` resolved: `cuda` when available, else `cpu`."""
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
