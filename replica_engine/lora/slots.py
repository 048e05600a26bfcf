"""Which adapter sits in which device slot, and which are held loaded in host memory: the policy
the model runner's LoRAManager runs on real weights and the simulator's replica on none.
Torch-free, so the simulator shares it.

A step's adapters (never more than the slots: the scheduler admits no more) each get a slot: the
one already holding it, else an empty one or one whose adapter the step does not use. An adapter
written into a slot comes from the host LRU of `max_loaded` (touched then), else from `load`,
after which the least recently used beyond `max_loaded` is dropped."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from common.lora import LoRARequest

Weights = TypeVar("Weights")


class AdapterSlots(Generic[Weights]):
    def __init__(self, num_slots: int, max_loaded: int, load: Callable[[LoRARequest], Weights]) -> None:
        self.slots: list[LoRARequest | None] = [None] * num_slots
        self.max_loaded = max_loaded
        self.load = load
        self.loaded: OrderedDict[LoRARequest, Weights] = OrderedDict()  # least recent first

    def assign(self, needed: Sequence[LoRARequest]) -> list[tuple[int, Weights]]:
        """Slots for a step's adapters (distinct); the (slot, weights) newly written."""
        written = []
        for lora in needed:
            if lora in self.slots:
                continue
            slot = next(i for i, held in enumerate(self.slots) if held is None or held not in needed)
            weights = self.loaded.pop(lora) if lora in self.loaded else self.load(lora)
            self.loaded[lora] = weights
            while len(self.loaded) > self.max_loaded:
                self.loaded.popitem(last=False)
            self.slots[slot] = lora
            written.append((slot, weights))
        return written
