"""The runner's adapters: loaded on demand from disk into a host LRU (`max_cpu_loras`), written
into one of `max_loras` device slots when a step needs them, and mapped to the step's tokens.

The scheduler admits no more adapters at once than there are slots, so every step's adapters fit;
a slot whose adapter the step does not use is rewritten when a new one comes. Loading happens on
the step thread the first time a step needs an adapter (the frontend checked the files already:
common/lora.read_adapter), and its time is kept in `load_times_s`."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from common.lora import AdapterInfo, LoRARequest, read_adapter
from replica_engine.lora.linear import LoRALinear, LoRAStep
from replica_engine.models.llama import LlamaForCausalLM, MergedLinear

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
        self.max_cpu_loras = max_cpu_loras
        self.dtype, self.device = dtype, device
        self.step = LoRAStep()
        self.linears: dict[tuple[int, str], LoRALinear] = {}  # (layer, attribute path) -> its slots
        for index, layer in enumerate(model.model.layers):
            for path in {place for place, _ in _PLACES.values()}:
                linear = layer.get_submodule(path)
                shards = linear.shard_sizes if isinstance(linear, MergedLinear) else [linear.out_features]
                ranges = [(sum(shards[:i]), sum(shards[: i + 1])) for i in range(len(shards))]
                linear.lora = self.linears[index, path] = LoRALinear(
                    linear.in_features, ranges, max_loras, max_lora_rank, self.step, dtype, device
                )
        self.slots: list[LoRARequest | None] = [None] * max_loras
        self._slot_ranks = [0] * max_loras
        self._loaded: OrderedDict[LoRARequest, AdapterWeights] = OrderedDict()  # least recent first
        self.load_times_s: dict[str, float] = {}  # adapter name -> seconds its last load from disk took

    @property
    def loaded(self) -> list[LoRARequest]:
        return list(self._loaded)

    def prepare(self, rows: Iterable[tuple[LoRARequest | None, int]]) -> None:
        """Map a step's rows ((adapter, tokens) in batch order) to slots, loading what is missing."""
        rows = list(rows)
        adapters = list(dict.fromkeys(lora for lora, _ in rows if lora is not None))
        if not adapters:
            self.step.clear()
            return
        slot_of = {lora: self._slot_for(lora, adapters) for lora in adapters}
        row_slots = torch.tensor([-1 if lora is None else slot_of[lora] for lora, _ in rows])
        token_slots = row_slots.repeat_interleave(torch.tensor([n for _, n in rows]))
        step_rank = max(self._slot_ranks[slot] for slot in slot_of.values())
        self.step.set(token_slots.to(self.device), step_rank, len(self.slots), self.dtype)

    def _slot_for(self, lora: LoRARequest, needed: list[LoRARequest]) -> int:
        if lora in self.slots:
            return self.slots.index(lora)
        slot = next(i for i, held in enumerate(self.slots) if held is None or held not in needed)
        weights = self._weights(lora)
        for linear in self.linears.values():
            linear.clear_slot(slot)
        for (layer, module), (a, b) in weights.tensors.items():
            path, shard = _PLACES[module]
            self.linears[layer, path].write(slot, shard, a, b, weights.info.scaling)
        self.slots[slot], self._slot_ranks[slot] = lora, weights.info.rank
        return slot

    def _weights(self, lora: LoRARequest) -> AdapterWeights:
        """From the host LRU, else from disk (then the least recently used beyond max_cpu_loras goes)."""
        weights = self._loaded.pop(lora, None)
        if weights is None:
            weights = self._load(lora)
        self._loaded[lora] = weights
        while len(self._loaded) > self.max_cpu_loras:
            self._loaded.popitem(last=False)
        return weights

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
