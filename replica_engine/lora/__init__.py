"""Multi-LoRA in the step: adapters' weights in device slots, applied per row (lora/linear.py),
loaded on demand and kept in an LRU (lora/manager.py), by a policy the simulator shares
(lora/slots.py, torch-free: nothing is imported here)."""
