"""Runs a step plan on the model: owns the KV cache tensors, builds the flat batch, samples."""

from __future__ import annotations

import torch

from replica_engine.config import EngineConfig
from replica_engine.flat_batch import build_flat_batch
from replica_engine.kv_cache_manager import KVCacheManager
from replica_engine.models.llama import LlamaForCausalLM
from replica_engine.request import Request
from replica_engine.sampler import sample
from replica_engine.sampling_params import SamplingParams
from replica_engine.scheduler.plan import StepPlan


class ModelRunner:
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
        return 2 * num_layers * block_size * num_kv_heads * head_dim * self.config.torch_dtype.itemsize

    def num_kv_blocks(self) -> int:
        """How many blocks the KV pool gets: kv_cache_bytes where given, else (GPU) what is left of
        gpu_memory_utilization after the weights and the peak of a full-budget step."""
        if self.config.kv_cache_bytes is not None:
            return self.config.kv_cache_bytes // self.bytes_per_block
        peak_activation_bytes = self._profile_peak_step_bytes()
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        used_bytes = total_bytes - free_bytes
        budget = total_bytes * self.config.gpu_memory_utilization - used_bytes - peak_activation_bytes
        return max(0, int(budget)) // self.bytes_per_block

    def _profile_peak_step_bytes(self) -> int:
        """Run one step of max_num_batched_tokens tokens against a throwaway pool and measure
        the memory it needed beyond what was allocated before."""
        num_tokens = self.config.max_num_batched_tokens
        pool = KVCacheManager(-(-num_tokens // self.config.block_size), self.config.block_size)
        self.allocate_kv_cache(pool.num_blocks)
        request = Request("profile", [0] * num_tokens, SamplingParams(max_tokens=1, temperature=0.0))
        pool.allocate(request, num_tokens)
        plan = StepPlan(num_tokens, {request: num_tokens})
        plan.seal()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.execute(plan)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [
            (
                torch.zeros((num_blocks, *self.kv_shape), dtype=self.config.torch_dtype, device=self.device),
                torch.zeros((num_blocks, *self.kv_shape), dtype=self.config.torch_dtype, device=self.device),
            )
            for _ in self.model.model.layers
        ]

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int]:
        """Compute every scheduled token; return one sampled token per `plan.sampling_requests`."""
        on_gpu = self.device.type == "cuda"
        batch = build_flat_batch(plan, self.config.block_size, pin_memory=on_gpu).to(self.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attention)
        sampling = plan.sampling_requests
        if not sampling:
            return []
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return sample(logits, sampling)
