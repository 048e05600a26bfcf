"""The runner's adapters: loaded on demand from disk into a host LRU (`max_cpu_loras`), written
into one of `max_loras` device slots when a step needs them, and mapped to the step's tokens.

Which slot and what stays loaded follow lora/slots.py (the simulator's replica runs the same
policy); the scheduler admits no more adapters at once than there are slots. Loading happens on
the step thread the first time a step needs an adapter (the frontend checked the files already:
common/lora.read_adapter), and its time is kept in `load_times_s`."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from common.lora import AdapterInfo, LoRARequest, read_adapter
from replica_engine.device_transfer import move_to
from replica_engine.lora.linear import LoRALinear, LoRAStep
from replica_engine.lora.slots import AdapterSlots
from replica_engine.models.layers import MergedLinear
from replica_engine.models.llama import LlamaForCausalLM
from replica_engine.models.moe import SparseMoeBlock

logger = logging.getLogger(__name__)

# PEFT's module name -> (our linear layer's attribute path in a decoder layer, shard index)
_PLACES = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}


@dataclass(frozen=True)
class AdapterWeights:
    info: AdapterInfo
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B)


class LoRAManager:
    def __init__(
        self,
        model: LlamaForCausalLM,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model_config = model.config
        self.max_lora_rank = max_lora_rank
        self.dtype, self.device = dtype, device
        self.step = LoRAStep()
        self.linears: dict[tuple[int, str], LoRALinear] = {}  # (layer, attribute path) -> its slots
        for index, layer in enumerate(model.model.layers):
            for path in {place for place, _ in _PLACES.values()}:
                if path.startswith("mlp.") and isinstance(layer.mlp, SparseMoeBlock):
                    continue  # experts take no adapters (read_adapter refuses MLP targets)
                linear = layer.get_submodule(path)
                shards = linear.shard_sizes if isinstance(linear, MergedLinear) else [linear.out_features]
                ranges = [(sum(shards[:i]), sum(shards[: i + 1])) for i in range(len(shards))]
                linear.lora = self.linears[index, path] = LoRALinear(
                    linear.in_features, ranges, max_loras, max_lora_rank, self.step, dtype, device
                )
        self.adapters = AdapterSlots(max_loras, max_cpu_loras, self._load)
        self._slot_ranks = [0] * max_loras
        self.load_times_s: dict[str, float] = {}  # adapter name -> seconds its last load from disk took

    @property
    def loaded(self) -> list[LoRARequest]:
        return list(self.adapters.loaded)

    def prepare(self, rows: Iterable[tuple[LoRARequest | None, int]]) -> None:
        """Map a step's rows ((adapter, tokens) in batch order) to slots, loading what is missing."""
        rows = list(rows)
        adapters = list(dict.fromkeys(lora for lora, _ in rows if lora is not None))
        if not adapters:
            self.step.clear()
            return
        for slot, weights in self.adapters.assign(adapters):
            self._write(slot, weights)
        slot_of = {lora: self.adapters.slots.index(lora) for lora in adapters}
        row_slots = torch.tensor([-1 if lora is None else slot_of[lora] for lora, _ in rows])
        token_slots = row_slots.repeat_interleave(torch.tensor([n for _, n in rows]))
        step_rank = max(self._slot_ranks[slot] for slot in slot_of.values())
        self.step.set(move_to(token_slots, self.device), step_rank, len(self._slot_ranks), self.dtype)

    def _write(self, slot: int, weights: AdapterWeights) -> None:
        for linear in self.linears.values():
            linear.clear_slot(slot)
        for (layer, module), (a, b) in weights.tensors.items():
            path, shard = _PLACES[module]
            self.linears[layer, path].write(slot, shard, a, b, weights.info.scaling)
        self._slot_ranks[slot] = weights.info.rank

    def _load(self, lora: LoRARequest) -> AdapterWeights:
        started = time.perf_counter()
        info = read_adapter(lora, self.model_config, self.max_lora_rank)
        stored = load_file(info.weights_path)
        tensors = {(t.layer, t.module): (stored[t.a_key], stored[t.b_key]) for t in info.tensors}
        self.load_times_s[lora.name] = time.perf_counter() - started
        logger.info(
            "LoRA adapter %r loaded from %s in %.3f s", lora.name, lora.path, self.load_times_s[lora.name]
        )
        return AdapterWeights(info, tensors)
