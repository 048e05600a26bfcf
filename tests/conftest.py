"""Shared fixtures: the embedded SmolLM2 is converted once (cached on disk) and its engine and
Hugging Face reference are loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported (transformers may import it early):
# without a GPU, its kernels run in the interpreter, on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common.model_source import DEFAULT_MODEL, resolve_model
from replica_engine import LLM

# Fixtures that start (or stand on) the session's Ray cluster.
RAY_FIXTURES = {"serve_cluster", "small_app", "prometheus"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that starts Ray is marked `ray` (so `make test-fast` can leave them out). Tests
    with a Ray cluster of their own run first: their `ray stop` stops every Ray process on the
    machine, which must not include the session's shared cluster (started later)."""
    for item in items:
        uses_shared = RAY_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if uses_shared or item.get_closest_marker("own_ray_cluster") is not None:
            item.add_marker(pytest.mark.ray)
    items.sort(key=lambda item: item.get_closest_marker("own_ray_cluster") is None)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model(DEFAULT_MODEL).hf_dir


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The default engine in float32 (`auto` is bf16 on CPUs with native bf16), default budget.
    Tests must leave it with no requests."""
    return LLM(dtype="float32")


@pytest.fixture(scope="session")
def exact_llm() -> LLM:
    """The default engine in float32 on the GGUF's weights dequantized: what the exactness tests
    hold against transformers (the default, the file's own blocks, rounds activations to int16)."""
    return LLM(dtype="float32", quantization="none")


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

    from harness import serve_cluster as cluster_lib

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


@pytest.fixture(scope="session")
def small_app(serve_cluster):
    """A second app on the same cluster, at /small: a KV pool of 8 blocks (128 tokens: four
    requests of 54 tokens cannot all fit, so the engine preempts), a 160-token context (a request
    may be too large for the whole pool), and a replica that holds 4 requests and queues 1 more
    (the rest get 503), a TBT target (the adaptive budget's path through Serve) and a bound on
    requests' priority (max_priority 10). An Ingress in front of an EngineReplica (the shipped app
    is colocated). Yields its base URL."""
    from ray import serve

    from deployments.app import AppArgs, build_app
    from harness.serve_cluster import delete_app

    args = AppArgs(
        ingress="separate",  # test_structured_outputs pauses its EngineReplica through the handle
        max_ongoing_requests=4,
        max_queued_requests=1,
        num_cpus=0,
        # tbt_slo_s: far above its steps even on a slow, loaded host (it changes no chunk: the
        # priority test in test_structured_outputs.py needs whole prompts admitted), set so the
        # budget's metrics exist
        engine={
            "num_kv_blocks": 8,
            "max_model_len": 160,
            "dtype": "float32",
            "tbt_slo_s": 10.0,
            "max_priority": 10,
        },
        sampling_defaults={"max_tokens": 256},
    )
    serve.run(build_app(args), name="small", route_prefix="/small")
    yield f"{serve_cluster.base_url}/small"
    delete_app("small")


@pytest.fixture(scope="session")
def prometheus(serve_cluster, tmp_path_factory: pytest.TempPathFactory):
    """A real Prometheus scraping the cluster (installed from Debian's package when missing)."""
    from harness.debian_package import find_or_install
    from tests.serve import prometheus_server

    binary, why_not = find_or_install("prometheus", "prometheus")
    if binary is None:
        pytest.skip(why_not)
    process, url = prometheus_server.start(binary, tmp_path_factory.mktemp("prometheus"))
    yield url
    process.terminate()
    process.wait(timeout=30)
