"""Runs a sealed step on the model: owns the KV cache tensors, builds the flat batch, samples.
It reads only the ScheduledBatch it is given, never a live request."""

from __future__ import annotations

import torch

from common.logprobs import TokenLogprob
from common.sampling_params import SamplingParams
from replica_engine.config import EngineConfig
from replica_engine.executor import RunnerOutput
from replica_engine.flat_batch import build_flat_batch
from replica_engine.kv_cache_manager import NULL_BLOCK_ID, blocks_for_tokens, blocks_in_bytes, kv_block_bytes
from replica_engine.logprobs import logprobs_of
from replica_engine.models.llama import LlamaForCausalLM
from replica_engine.sampler import sample
from replica_engine.scheduler.plan import SamplingRow, ScheduledBatch, ScheduledRow

PROMPT_LOGPROBS_SLICE = 512  # positions per logits pass: 512 x a 128k vocabulary is 256 MB of fp32


class ModelRunner:
    """The Executor of a real replica."""

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.device = config.torch_device
        attention = model.model.layers[0].self_attn
        self.kv_shape = (config.block_size, attention.num_kv_heads, attention.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block of tokens."""
        block_size, num_kv_heads, head_dim = self.kv_shape
        num_layers = len(self.model.model.layers)
        return kv_block_bytes(
            num_layers, block_size, num_kv_heads, head_dim, self.config.torch_dtype.itemsize
        )

    def num_kv_blocks(self) -> int:
        """How many blocks requests may hold (the null block comes on top): num_kv_blocks where
        given; else what kv_cache_bytes holds; else (GPU) what is left of gpu_memory_utilization
        after the weights and the peak of a full-budget step."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_bytes is not None:
            return blocks_in_bytes(self.config.kv_cache_bytes, self.bytes_per_block)
        peak_activation_bytes = self._profile_peak_step_bytes()
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        used_bytes = total_bytes - free_bytes
        budget = total_bytes * self.config.gpu_memory_utilization - used_bytes - peak_activation_bytes
        return blocks_in_bytes(max(0, int(budget)), self.bytes_per_block)

    def _profile_peak_step_bytes(self) -> int:
        """Run one step of max_num_batched_tokens tokens against a throwaway pool and measure
        the memory it needed beyond what was allocated before."""
        num_tokens = self.config.max_num_batched_tokens
        num_blocks = blocks_for_tokens(num_tokens, self.config.block_size)
        self.allocate_kv_cache(num_blocks + 1)
        sampling = SamplingRow(SamplingParams(max_tokens=1, temperature=0.0), None)
        row = ScheduledRow(
            "profile", (0,) * num_tokens, 0, tuple(range(NULL_BLOCK_ID + 1, num_blocks + 1)), False, sampling
        )
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.execute(ScheduledBatch((row,)))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, pool_size: int) -> None:
        """`pool_size` blocks per layer for K and for V, the null block included."""
        self.kv_caches = [
            (
                torch.zeros((pool_size, *self.kv_shape), dtype=self.config.torch_dtype, device=self.device),
                torch.zeros((pool_size, *self.kv_shape), dtype=self.config.torch_dtype, device=self.device),
            )
            for _ in self.model.model.layers
        ]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Compute every scheduled token; sample one token per `batch.sampling_rows`."""
        on_gpu = self.device.type == "cuda"
        flat = build_flat_batch(batch, self.config.block_size, pin_memory=on_gpu).to(self.device)
        hidden = self.model(flat.input_ids, flat.positions, self.kv_caches, flat.attention)
        prompt_logprobs = self._prompt_logprobs(batch.rows, hidden)
        sampling = [row.sampling for row in batch.rows if row.sampling is not None]
        if not sampling:
            return RunnerOutput(prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[flat.logits_indices])
        return RunnerOutput(sample(logits, sampling), prompt_logprobs)

    def _prompt_logprobs(
        self, rows: tuple[ScheduledRow, ...], hidden: torch.Tensor
    ) -> dict[str, list[TokenLogprob]]:
        """Logprobs of the prompt tokens each asking row's chunk predicts (rows' tokens lie in
        `hidden` one after another, in batch order)."""
        results: dict[str, list[TokenLogprob]] = {}
        row_start = 0
        for row in rows:
            wanted = row.prompt_logprobs
            if wanted is not None:
                found = results.setdefault(row.request_id, [])
                first = row_start + wanted.offset
                for done in range(0, len(wanted.targets), PROMPT_LOGPROBS_SLICE):
                    targets = list(wanted.targets[done : done + PROMPT_LOGPROBS_SLICE])
                    at = first + done
                    logits = self.model.compute_logits(hidden[at : at + len(targets)])
                    found += logprobs_of(logits, targets, [wanted.num_top] * len(targets))
            row_start += row.num_tokens
        return results
