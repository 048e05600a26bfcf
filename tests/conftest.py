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


@pytest.fixture(scope="session")
def serve_cluster(tmp_path_factory: pytest.TempPathFactory):
    """serve_config.yaml running on a real local Ray cluster; the test process is attached as a
    driver (for replica handles). Started once per session: it takes ~30 s on 2 cores."""
    import ray

    from tests import serve_cluster as cluster_lib

    log_dir = tmp_path_factory.mktemp("serve")
    cluster = cluster_lib.start(cluster_lib.REPO / "serve_config.yaml", log_dir)
    try:
        cluster.wait_ready()
        ray.init(address=cluster.ray_address, logging_level="ERROR", log_to_driver=False)
        yield cluster
    except BaseException:
        print((log_dir / "serve_run.log").read_text()[-5000:])
        raise
    finally:
        ray.shutdown()
        cluster_lib.stop(cluster)
