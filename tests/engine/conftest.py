"""The engine tests' own fixtures."""

from __future__ import annotations

import pytest

from replica_engine.engine_core import EngineCore


@pytest.fixture
def unpriced_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built in the test speculate without a step-time model: the budget alone prices
    their drafts (DraftPricing). A model is fitted on the startup profile and refitted on the live
    steps, and on a busy host their noisy times can price every draft out, so a test of what
    speculation yields would check nothing. Pricing has tests of its own (test_spec_proposers.py)."""
    monkeypatch.setattr(EngineCore, "_profiled_step_time", lambda self, num_kv_blocks: None)
