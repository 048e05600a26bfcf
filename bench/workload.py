"""Importable for tests/engine/test_token_budget_threads.py as committed (its working copy no longer
imports bench/): random_tokens lives in harness.random_workload, percentile in harness.latency.
Delete once that test's new version is committed."""

from harness.latency import percentile
from harness.random_workload import random_tokens

__all__ = ["percentile", "random_tokens"]
