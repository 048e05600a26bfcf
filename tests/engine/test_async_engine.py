"""AsyncEngine: streaming on a background thread; cancellation ends the stream at once and frees
its blocks by the end of the step that was running."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import pytest

from replica_engine import AsyncEngine, EngineConfig, EngineStats, InvalidRequestError, SamplingParams
from tests.engine.engine_idle import is_idle, wait_idle


@pytest.fixture(scope="module")
def async_engine():
    engine = AsyncEngine(EngineConfig(dtype="float32", core_process=True))  # the core's own process
    yield engine
    engine.shutdown()


def test_streams_equal_offline_and_run_concurrently(async_engine, llm):
    prompts = ["The capital of France is", "1, 2, 3,", "def square(x):", "Hello there"]
    params = SamplingParams(max_tokens=12, temperature=0)
    offline = [o.outputs[0].text for o in llm.generate(prompts, params)]

    async def collect(prompt: str) -> tuple[str, int, str]:
        stream = await async_engine.add_request(prompt, params)
        text, chunks, reason = "", 0, None
        async for out in stream:
            text += out.text_delta
            chunks += 1
            reason = out.finish_reason
        return text, chunks, reason

    async def main():
        return await asyncio.gather(*(collect(p) for p in prompts))

    results = asyncio.run(main())
    assert [text for text, _, _ in results] == offline
    assert all(chunks > 1 and reason == "length" for _, chunks, reason in results)
    assert is_idle(async_engine.stats())  # published by the step that finished them


def test_closing_a_stream_early_aborts_and_frees_its_blocks(async_engine):
    async def main():
        stream = await async_engine.add_request(
            "Count: 1, 2, 3,", SamplingParams(max_tokens=500, temperature=0)
        )
        async for out in stream:
            if out.num_output_tokens >= 3:
                break
        await stream.aclose()

    asyncio.run(main())
    wait_idle(async_engine.stats)


def _idle_once_added(engine: AsyncEngine) -> Callable[[], EngineStats]:
    """The engine's stats, read as busy until the core has taken a request added from now on
    (before, they are idle anyway)."""
    added = engine.stats().num_requests_added

    def stats() -> EngineStats:
        latest = engine.stats()
        return latest if latest.num_requests_added > added else replace(latest, num_running=1)

    return stats


def test_closing_a_stream_never_read_aborts(async_engine):
    stats = _idle_once_added(async_engine)

    async def main():
        stream = await async_engine.add_request(
            "Count: 1, 2, 3,", SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0)
        )
        await stream.aclose()  # its 4000 tokens would take many seconds
        # on this loop: once it has closed, the engine drops the requests it read for anyway
        await asyncio.to_thread(wait_idle, stats)

    asyncio.run(main())


def test_a_reader_behind_reads_the_steps_it_missed_as_one_output(async_engine, llm):
    """A stream's outputs queued while its reader was busy come out as one: every token and all
    the text of those steps, and the finish, in the order the steps made them."""
    prompt, params = "1, 2, 3,", SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    offline = llm.generate([prompt], params)[0].outputs[0]
    stats = _idle_once_added(async_engine)

    async def main():
        stream = await async_engine.add_request(prompt, params)
        await asyncio.to_thread(wait_idle, stats)  # every step ran and queued its output, none read
        return [out async for out in stream]

    outputs = asyncio.run(main())
    assert len(outputs) == 1
    (output,) = outputs
    assert output.new_token_ids == offline.token_ids and output.text_delta == offline.text
    assert output.finished and output.finish_reason == "length" and output.num_output_tokens == 12


def test_cancelling_the_reading_task_aborts(async_engine):
    async def main():
        stream = await async_engine.add_request(
            "Tell me everything:", SamplingParams(max_tokens=500, temperature=0)
        )
        first = asyncio.Event()

        async def read():
            async for _ in stream:
                first.set()

        task = asyncio.create_task(read())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_idle(async_engine.stats)


def test_abort_from_elsewhere_ends_the_stream_with_abort(async_engine):
    async def main():
        stream = await async_engine.add_request(
            "Go on and on:", SamplingParams(max_tokens=500), request_id="victim"
        )
        reasons = []
        async for out in stream:
            if out.num_output_tokens == 2:
                async_engine.abort("victim")
            reasons.append(out.finish_reason)
        return reasons

    reasons = asyncio.run(main())
    assert reasons == [None, None, "abort"]  # nothing after the abort: the stream ended at once
    wait_idle(async_engine.stats)


def test_bad_request_raises_at_add_time(async_engine):
    async def main():
        await async_engine.add_request("hi", SamplingParams(max_tokens=9000))

    with pytest.raises(InvalidRequestError):
        asyncio.run(main())
    assert async_engine.is_healthy


def test_a_paused_engine_holds_its_requests_orders_new_ones_on_resume_and_loses_nothing(llm):
    """One request at a time (max_num_seqs 1). A runs; paused, the core takes no step: A's context
    stays put across snapshots, B (priority 5) and C (-5) wait, and D is aborted while it waits.
    On resume A ends as if never paused, then C before B: both waited together when the
    scheduler next chose (had the core stepped after B arrived, B would have run first)."""
    engine = AsyncEngine(EngineConfig(dtype="float32", core_process=True, max_num_seqs=1))
    params = SamplingParams(max_tokens=16, temperature=0)
    (expected,) = llm.generate(["Count: 1, 2, 3,"], params)

    async def until(predicate) -> EngineStats:
        deadline = asyncio.get_running_loop().time() + 60  # a hang detector on a loaded host
        while not predicate(latest := engine.stats()):
            assert asyncio.get_running_loop().time() < deadline, f"not within 60 s: {latest}"
            await asyncio.sleep(0.005)
        return latest

    async def read(stream, firsts: list[str], name: str) -> str:
        text = ""
        async for out in stream:
            if not text:
                firsts.append(name)
            text += out.text_delta
        return text

    async def main() -> tuple[str, list[str]]:
        firsts: list[str] = []
        a_stream = await engine.add_request("Count: 1, 2, 3,", params)
        first = await anext(a_stream)
        engine.pause()
        b = asyncio.create_task(
            read(await engine.add_request("Hi", SamplingParams(max_tokens=2, priority=5)), firsts, "b")
        )
        paused = await until(lambda s: s.num_waiting == 1)  # the pause came first: no step since
        c = asyncio.create_task(
            read(await engine.add_request("Yo", SamplingParams(max_tokens=2, priority=-5)), firsts, "c")
        )
        await until(lambda s: s.num_waiting == 2)
        d = asyncio.create_task(
            read(await engine.add_request("Go", SamplingParams(max_tokens=2)), firsts, "d")
        )
        await until(lambda s: s.num_waiting == 3)
        d.cancel()  # its reader leaves: an abort, applied while paused
        latest = await until(lambda s: s.num_waiting == 2)
        assert (
            latest.num_running == 1 and latest.num_running_context_tokens == paused.num_running_context_tokens
        )
        engine.resume()
        a_text = first.text_delta + await read(a_stream, [], "a")
        await asyncio.gather(b, c)
        return a_text, firsts

    try:
        a_text, firsts = asyncio.run(main())
        assert a_text == expected.outputs[0].text
        assert firsts == ["c", "b"]
        wait_idle(engine.stats)
    finally:
        engine.shutdown()
