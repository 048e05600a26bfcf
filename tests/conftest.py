"""Shared fixtures: the embedded SmolLM2 is converted once (cached on disk) and its engine and
Hugging Face reference are loaded once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replica_engine import LLM
from replica_engine.models.sources import DEFAULT_MODEL, resolve_model


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model(DEFAULT_MODEL).hf_dir


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The default engine (float32 CPU, default budget). Tests must leave it with no requests."""
    return LLM()


@pytest.fixture(scope="session")
def tokenizer(llm: LLM):
    return llm.tokenizer


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
