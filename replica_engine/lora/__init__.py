"""Multi-LoRA in the step: adapters' weights in device slots, applied per row (lora/linear.py),
loaded on demand and kept in an LRU (lora/manager.py)."""

from replica_engine.lora.manager import LoRAManager

__all__ = ["LoRAManager"]
