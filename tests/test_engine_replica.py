"""The EngineReplica class on its own (no Ray cluster: Serve would only call these same methods),
with the real SmolLM2 engine."""

from __future__ import annotations

import asyncio

import pytest

from deployments.engine_replica import EngineReplica, wrap_int64
from deployments.messages import ChoiceDelta, GenerateError, GenerateRequest
from replica_engine import EngineConfig
from replica_engine.async_engine import MAX_CONSECUTIVE_STEP_FAILURES
from tests.engine_idle import is_idle, wait_idle


@pytest.fixture
def replica():
    replica = EngineReplica.func_or_class(EngineConfig(kv_cache_bytes=32 << 20, dtype="float32"), "smollm2")
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
    assert is_idle(replica.stats())


def test_choices_stream_to_their_end(replica: EngineReplica):
    request = GenerateRequest("r2", prompts=["Hello", "Goodbye"], n=2, sampling={"max_tokens": 5, "seed": 3})
    deltas = [d for batch in asyncio.run(collect(replica, request)) for d in batch]
    for index in range(4):
        mine = [d for d in deltas if d.index == index]
        assert sum(len(d.token_ids) for d in mine) == 5 and mine[-1].finish_reason == "length"
    assert is_idle(replica.stats())


def test_a_failing_choice_ends_its_request_with_a_500_and_the_replica_goes_on(replica: EngineReplica):
    # A device fault cannot be caused on purpose on a CPU: the runner raises for one request.
    runner = replica.engine.core.runner
    execute = runner.execute

    def faulty_execute(batch):
        if any(row.request_id.startswith("poison") for row in batch.rows):
            raise RuntimeError("injected fault")
        return execute(batch)

    runner.execute = faulty_execute
    good = GenerateRequest("good", prompts=["Hello"], sampling={"max_tokens": 6, "temperature": 0})
    poison = GenerateRequest("poison", prompts=["Hello"], n=2, sampling={"max_tokens": 6})

    async def both():
        return await asyncio.wait_for(asyncio.gather(collect(replica, good), collect(replica, poison)), 60)

    good_items, poison_items = asyncio.run(both())
    assert [type(item) for item in poison_items] == [GenerateError]
    assert (poison_items[0].status, poison_items[0].code) == (500, "engine_error")
    assert sum(len(d.token_ids) for batch in good_items for d in batch) == 6
    replica.check_health()  # one failed request does not make the replica unhealthy
    wait_idle(replica.stats)  # the poisoned request's other choice is aborted when it fails


def test_health_check_fails_once_every_step_keeps_failing(replica: EngineReplica):
    def broken_execute(batch):
        raise RuntimeError("device lost")

    replica.engine.core.runner.execute = broken_execute
    statuses = []
    for i in range(MAX_CONSECUTIVE_STEP_FAILURES + 1):
        request = GenerateRequest(f"r{i}", prompts=["Hello"], sampling={"max_tokens": 4})
        items = asyncio.run(asyncio.wait_for(collect(replica, request), timeout=30))  # never hangs
        assert len(items) == 1 and isinstance(items[0], GenerateError)
        statuses.append(items[0].status)
    # Each request fails (500); after MAX failing steps in a row the engine stops: 503 from then on.
    assert statuses == [500] * MAX_CONSECUTIVE_STEP_FAILURES + [503]
    with pytest.raises(RuntimeError, match="engine step loop died"):
        replica.check_health()


def test_seeds_of_choices_stay_in_int64():
    assert wrap_int64(2**63 - 1 + 1) == -(2**63)
    assert wrap_int64(5) == 5 and wrap_int64(-(2**63)) == -(2**63)
