"""The EngineReplica class on its own (no Ray cluster: Serve would only call these same methods),
with the real SmolLM2 engine."""

from __future__ import annotations

import asyncio

import pytest

from deployments.engine_replica import EngineReplica, wrap_int64
from deployments.messages import ChoiceDelta, GenerateError, GenerateRequest
from replica_engine import EngineConfig, EngineDeadError


@pytest.fixture
def replica():
    replica = EngineReplica.func_or_class(EngineConfig(kv_cache_bytes=32 << 20), "smollm2")
    yield replica
    replica.engine.shutdown()


async def collect(
    replica: EngineReplica, request: GenerateRequest
) -> list[list[ChoiceDelta] | GenerateError]:
    return [item async for item in replica.generate(request)]


def test_a_refused_input_leaves_nothing_running(replica: EngineReplica):
    request = GenerateRequest("r1", prompts=["Hello there", ""], sampling={"max_tokens": 4})
    items = asyncio.run(collect(replica, request))
    assert len(items) == 1 and isinstance(items[0], GenerateError) and items[0].param == "prompt"
    stats = replica.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_choices_stream_to_their_end(replica: EngineReplica):
    request = GenerateRequest("r2", prompts=["Hello", "Goodbye"], n=2, sampling={"max_tokens": 5, "seed": 3})
    deltas = [d for batch in asyncio.run(collect(replica, request)) for d in batch]
    for index in range(4):
        mine = [d for d in deltas if d.index == index]
        assert sum(len(d.token_ids) for d in mine) == 5 and mine[-1].finish_reason == "length"
    assert replica.stats().num_free_blocks == replica.stats().num_total_blocks


def test_health_check_fails_once_the_step_loop_dies(replica: EngineReplica):
    replica.check_health()

    # A device fault cannot be caused on purpose on a CPU: stand one in for the model forward.
    def broken_forward(plan):
        raise RuntimeError("device lost")

    replica.engine.engine.runner.execute = broken_forward
    request = GenerateRequest("r3", prompts=["Hello"], sampling={"max_tokens": 4})
    with pytest.raises(EngineDeadError):  # the stream fails loudly instead of hanging
        asyncio.run(asyncio.wait_for(collect(replica, request), timeout=30))
    with pytest.raises(RuntimeError, match="device lost"):
        replica.check_health()


def test_seeds_of_choices_stay_in_int64():
    assert wrap_int64(2**63 - 1 + 1) == -(2**63)
    assert wrap_int64(5) == 5 and wrap_int64(-(2**63)) == -(2**63)
