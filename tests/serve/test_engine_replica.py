"""The EngineReplica class on its own (no Ray cluster: Serve would only call these same methods),
with the real SmolLM2 engine."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from contextlib import aclosing

import pytest

from common.block_hash import root_hash
from common.messages import ChoiceDelta, Embeddings, EmbedRequest, GenerateError, GenerateRequest
from common.routing_stats import RoutingStats
from deployments.engine_replica import EngineReplica
from replica_engine import EngineConfig, SamplingParams
from replica_engine.core_loop import MAX_CONSECUTIVE_STEP_FAILURES
from tests.engine.engine_idle import is_idle, wait_idle


def running_replica(core_process: bool) -> Iterator[EngineReplica]:
    """A replica for a fixture to yield, its engine shut down afterwards."""
    config = EngineConfig(kv_cache_bytes=32 << 20, dtype="float32", core_process=core_process)
    replica = EngineReplica.func_or_class(config, "smollm2")
    yield replica
    replica.engine.shutdown()


@pytest.fixture(scope="module")
def replica():
    """Its core in a process of its own; the tests that share it leave it idle and healthy."""
    yield from running_replica(core_process=True)


@pytest.fixture
def doomed_replica():
    """A replica of its own, for a test that kills its core."""
    yield from running_replica(core_process=True)


@pytest.fixture
def threaded_replica():
    """The core on a thread of this process, where a test can reach its model runner and make it
    fail (a device fault cannot be caused on purpose on a CPU)."""
    yield from running_replica(core_process=False)


def generate_request(
    replica: EngineReplica, request_id: str, texts: list[str], n: int = 1, **sampling: object
) -> GenerateRequest:
    """As the Ingress builds it: token ids and one SamplingParams per prompt."""
    ids = [replica.engine.inputs.prompts.tokenize(text) for text in texts]
    return GenerateRequest(request_id, ids, [SamplingParams(**sampling, n=n) for _ in ids])


async def collect(
    replica: EngineReplica, request: GenerateRequest
) -> list[list[ChoiceDelta] | GenerateError]:
    return [item async for item in replica.generate(request)]


def test_a_refused_input_leaves_nothing_running(replica: EngineReplica):
    # The second prompt's max_tokens fits the context but not this replica's KV pool (the one
    # check only a replica can make), so the first, already started, must be aborted.
    ids = replica.engine.inputs.prompts.tokenize("Hello there")
    pool_tokens = replica.engine.inputs.num_kv_blocks * 16
    params = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=pool_tokens)]
    items = asyncio.run(collect(replica, GenerateRequest("r1", [ids, ids], params)))
    assert len(items) == 1 and isinstance(items[0], GenerateError) and items[0].param == "prompt"
    assert items[0].code == "context_length_exceeded"
    wait_idle(replica.stats)  # the abort reaches the step thread between steps


def test_choices_stream_to_their_end(replica: EngineReplica):
    request = generate_request(replica, "r2", ["Hello", "Goodbye"], n=2, max_tokens=5, seed=3)
    deltas = [d for batch in asyncio.run(collect(replica, request)) for d in batch]
    for index in range(4):
        mine = [d for d in deltas if d.index == index]
        assert sum(len(d.token_ids) for d in mine) == 5 and mine[-1].finish_reason == "length"
    assert is_idle(replica.stats())


def test_a_failing_choice_ends_its_request_with_a_500_and_the_replica_goes_on(threaded_replica):
    replica = threaded_replica
    runner = replica.engine.client.core.runner  # raises for one request
    execute = runner.execute

    def faulty_execute(batch):
        if any(row.request_id.startswith("poison") for row in batch.rows):
            raise RuntimeError("injected fault")
        return execute(batch)

    runner.execute = faulty_execute
    good = generate_request(replica, "good", ["Hello"], max_tokens=6, temperature=0)
    poison = generate_request(replica, "poison", ["Hello"], n=2, max_tokens=6)

    async def both():
        return await asyncio.wait_for(asyncio.gather(collect(replica, good), collect(replica, poison)), 60)

    good_items, poison_items = asyncio.run(both())
    assert [type(item) for item in poison_items] == [GenerateError]
    assert (poison_items[0].status, poison_items[0].code) == (500, "engine_error")
    assert sum(len(d.token_ids) for batch in good_items for d in batch) == 6
    replica.check_health()  # one failed request does not make the replica unhealthy
    wait_idle(replica.stats)  # the poisoned request's other choice is aborted when it fails


def test_the_replica_exits_once_every_step_keeps_failing(threaded_replica: EngineReplica):
    replica = threaded_replica

    def broken_execute(batch):
        raise RuntimeError("device lost")

    replica.engine.client.core.runner.execute = broken_execute
    statuses = []
    for i in range(MAX_CONSECUTIVE_STEP_FAILURES + 1):
        request = generate_request(replica, f"r{i}", ["Hello"], max_tokens=4)
        items = asyncio.run(asyncio.wait_for(collect(replica, request), timeout=30))  # never hangs
        assert len(items) == 1 and isinstance(items[0], GenerateError)
        statuses.append(items[0].status)
    # Each request fails (500); after MAX failing steps in a row the engine stops: 503 from then on.
    assert statuses == [500] * MAX_CONSECUTIVE_STEP_FAILURES + [503]
    assert health_check_exits(replica)


def test_embed_answers_every_input_in_order_from_the_core_process(replica: EngineReplica):
    """Embeddings come back from the core's own process, in input order, each as it is alone; an
    input the KV pool could never hold refuses the request and aborts the inputs started."""
    prompts = replica.engine.inputs.prompts
    ids = [prompts.tokenize(text) for text in ("Hello there", "A lighthouse on a rock")]

    async def embed(request: EmbedRequest) -> list[Embeddings | GenerateError]:
        return [item async for item in replica.embed(request)]

    [both] = asyncio.run(embed(EmbedRequest("e1", ids)))
    assert isinstance(both, Embeddings) and both.num_prompt_tokens == sum(map(len, ids))
    for index, prompt in enumerate(ids):
        [alone] = asyncio.run(embed(EmbedRequest(f"e2-{index}", [prompt])))
        assert isinstance(alone, Embeddings) and len(alone.vectors[0]) == 576
        assert max(abs(a - b) for a, b in zip(alone.vectors[0], both.vectors[index], strict=True)) < 1e-5
    pool_tokens = replica.engine.inputs.num_kv_blocks * 16
    [refused] = asyncio.run(embed(EmbedRequest("e3", [ids[0], [1] * (pool_tokens + 1)])))
    assert isinstance(refused, GenerateError)
    assert (refused.param, refused.code) == ("prompt", "context_length_exceeded")
    wait_idle(replica.stats)


def test_the_routing_report_is_a_whole_routing_stats_message(replica):
    first, second = (RoutingStats.from_report(replica.record_routing_stats()) for _ in range(2))
    assert first is not None and second is not None
    assert first.num_free_blocks == first.num_total_blocks == replica.engine.stats().num_total_blocks
    assert second.report_seq == first.report_seq + 1
    assert first.hash_root == root_hash(replica.engine.inputs.config.model, None)


def test_the_routing_report_counts_a_request_of_n_choices_as_one_call_as_serve_does(replica):
    """Routers set Serve's cached queue length from the report: the calls the replica serves."""

    async def main() -> tuple[RoutingStats | None, RoutingStats | None]:
        request = generate_request(replica, "r-n", ["Count: 1, 2, 3,"], n=3, max_tokens=200)
        items = aclosing(replica.generate(request))
        async with items as stream:
            await anext(stream)  # the call is running, its 3 choices in the engine
            during = RoutingStats.from_report(replica.record_routing_stats())
        return during, RoutingStats.from_report(replica.record_routing_stats())

    during, after = asyncio.run(main())
    assert during is not None and during.num_ongoing_requests == 1
    assert after is not None and after.num_ongoing_requests == 0
    wait_idle(replica.stats)  # closing the call aborted its choices


def health_check_exits(replica: EngineReplica) -> bool:
    """Serve's health check on a replica whose engine has stopped: it exits the process (here the
    test's own: the exit is recorded instead) once no call runs."""
    exits: list[int] = []
    replica.exit_process = exits.append
    replica.check_health()
    return exits == [1]


def test_the_core_process_dying_mid_stream_fails_its_streams_and_the_replica_exits(
    doomed_replica: EngineReplica,
):
    """The engine core's own process is killed (as the kernel's OOM killer would) while a request
    streams: the stream ends with an error at once, a new request is refused with a 503, and the
    health check fails while the stream's call runs, then exits the replica (Serve replaces it at
    once: tests/serve/test_core_process.py)."""
    replica = doomed_replica
    request = generate_request(replica, "long", ["Count: 1, 2, 3,"], max_tokens=400, ignore_eos=True)

    async def stream_until_killed() -> list[list[ChoiceDelta] | GenerateError]:
        items = []
        async for item in replica.generate(request):
            items.append(item)
            if len(items) == 2:  # streaming: kill the core
                os.kill(replica.engine.client.pid, signal.SIGKILL)
            if isinstance(item, GenerateError):  # the call still runs: its stream has not ended
                with pytest.raises(RuntimeError, match="engine step loop died"):
                    replica.check_health()
        return items

    items = asyncio.run(asyncio.wait_for(stream_until_killed(), timeout=60))  # never hangs
    last = items[-1]
    assert isinstance(last, GenerateError) and (last.status, last.code) == (500, "engine_error")
    assert sum(len(d.token_ids) for batch in items[:-1] for d in batch) < 400
    refused = asyncio.run(collect(replica, generate_request(replica, "after", ["Hello"], max_tokens=4)))
    assert len(refused) == 1 and (refused[0].status, refused[0].code) == (503, "engine_unavailable")
    assert health_check_exits(replica)
