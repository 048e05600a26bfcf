"""Random LoRA adapters in PEFT's format, built by `peft` itself on a model's real shape (nothing
downloaded): what the LoRA tests and bench.engine.lora serve. PEFT starts B at zero (a no-op adapter);
these draw A and B at random, so each adapter visibly changes the model's output."""

from __future__ import annotations

from pathlib import Path

import torch

from common.lora import TARGET_MODULES


def save_random_adapter(
    base_model: torch.nn.Module,
    path: Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    target_modules: tuple[str, ...] = TARGET_MODULES,
    std: float = 0.02,
) -> Path:
    """Write an adapter for `base_model` (a transformers model, left unchanged) under `path`."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(base_model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    peft_model.save_pretrained(str(path))
    peft_model.unload()  # the base model's own layers back in place
    return path
