"""Engine integrity: an abort from another thread, landing at any moment of a step, can never
change another request's tokens. By construction: the step thread alone changes engine state
(aborts are messages it applies between steps), the model runner reads only the sealed copy of
its step, and block tables are padded with a null block that no request ever holds.

The real SmolLM2 runs everything here; the one stand-in is a wrapper around the real model
runner's `execute` that fires an abort at the start of a step, so the abort lands mid-step on
every run instead of by chance."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
import threading

import pytest

from common.finish_reason import FinishReason
from replica_engine import AsyncEngine, EngineConfig, SamplingParams
from replica_engine.attention import NullBlockWriteError
from replica_engine.flat_batch import FlatBatch, build_flat_batch
from replica_engine.kv_cache_manager import NULL_BLOCK_ID
from replica_engine.persistent_batch import PersistentBatch
from replica_engine.request import Request
from replica_engine.scheduler.plan import ScheduledBatch, ScheduledRow
from tests.engine.engine_idle import wait_idle
from tests.engine.scheduler_harness import make_scheduler, scheduled_tokens

STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
    "father had taught him, one hundred and twelve of them, worn smooth in the middle by two centuries "
    "of boots. At the top he trimmed the wick, polished the great lens until it shone like still water, "
    "and lit the lamp that would turn all night above the rocks where so many ships had been lost. "
)
GREEDY = {"temperature": 0, "ignore_eos": True}


def story_ids(tokenizer, num_tokens: int, offset: int = 0) -> list[int]:
    ids = tokenizer.encode(STORY * 8)
    return ids[offset : offset + num_tokens]


# -- the sealed plan and the null block, without a model --------------------------------------


def test_a_sealed_batch_keeps_its_copies_when_the_request_is_aborted():
    scheduler = make_scheduler("stall_free", budget=64, max_seqs=4, num_blocks=8, block_size=4)
    request = Request("a", list(range(1, 11)), SamplingParams(max_tokens=4))
    scheduler.add_request(request)
    batch = scheduler.schedule()
    blocks = tuple(request.block_ids)
    scheduler.finish_request(request, FinishReason.ABORT)  # what an abort did mid-step before
    assert request.block_ids == [] and batch.rows[0].new_block_ids == blocks
    assert NULL_BLOCK_ID not in blocks
    flat = _flat(batch)
    assert set((flat.attention.slot_mapping // 4).tolist()) == set(blocks)  # its own blocks only
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.rows[0].new_block_ids = ()  # type: ignore[misc]


def _row(request_id: str, num_tokens: int, block_ids: tuple[int, ...]) -> ScheduledRow:
    return ScheduledRow(request_id, (1,) * num_tokens, 0, block_ids, False, None)


def _flat(batch: ScheduledBatch) -> FlatBatch:
    """As the model runner builds it, through a persistent batch (block size 4)."""
    rows = PersistentBatch(max_num_seqs=4, max_num_tokens=64, block_size=4, vocab_size=8)
    rows.apply(batch)
    return build_flat_batch(batch, rows.block_tables(batch), block_size=4)


def test_block_tables_are_padded_with_the_null_block():
    batch = ScheduledBatch((_row("long", 9, (3, 1, 4)), _row("short", 2, (2,))))
    flat = _flat(batch)
    assert flat.attention.block_tables.tolist() == [[3, 1, 4], [2, NULL_BLOCK_ID, NULL_BLOCK_ID]]


def test_a_real_token_is_never_written_into_the_null_block():
    # A row whose table is one block short (a bug upstream) fails the step before any layer runs.
    batch = ScheduledBatch((_row("short-table", 6, (2,)),))
    with pytest.raises(NullBlockWriteError):
        _flat(batch)


def test_a_recomputed_cached_token_writes_its_kv_into_the_null_block():
    # A prefix-cache hit recomputed from its last token (for the next token's prompt logprob):
    # that token's K/V is in a block other requests read, so the step writes it to scratch.
    row = dataclasses.replace(_row("hit", 5, (3, 1)), start_position=3, num_cached_kv_tokens=1)
    flat = _flat(ScheduledBatch((row,)))
    assert flat.attention.slot_mapping.tolist() == [NULL_BLOCK_ID * 4, 4, 5, 6, 7]


# -- the real model, aborts from other threads --------------------------------------------------


async def _collect(stream) -> tuple[list[int], list[str | None]]:
    tokens, reasons = [], []
    async for output in stream:
        tokens += output.new_token_ids
        reasons.append(output.finish_reason)
    return tokens, reasons


def test_an_abort_landing_mid_step_never_touches_another_requests_kv(llm, tokenizer):
    """The victim is aborted from another thread at the start of the step that computes its first
    prompt chunk, while the keeper (decoding) holds the pool's last block, whole: the block a
    table padded with -1 would have written into."""
    num_blocks = 16
    keeper_prompt = story_ids(tokenizer, 96)  # 6 full blocks
    keeper_params = SamplingParams(max_tokens=12, **GREEDY)
    expected = llm.generate([keeper_prompt], keeper_params)[0].outputs[0].token_ids
    # The core on a thread of this process: the test steps into its runner.
    config = EngineConfig(
        num_kv_blocks=num_blocks, max_num_batched_tokens=32, dtype="float32", core_process=False
    )
    engine = AsyncEngine(config)
    core = engine.client.core
    real_execute = core.runner.execute
    seen: dict[str, object] = {}

    def execute_aborting_the_victim(batch: ScheduledBatch) -> list[int]:
        # The core knows a request by its id and a count (AsyncEngine's key for each add).
        if any(rid.startswith("victim#") for rid in scheduled_tokens(batch)) and "aborted" not in seen:
            # On the step thread, which owns the state: may the keeper's table be read here.
            keeper = next(r for r in core.scheduler.requests.values() if r.request_id.startswith("keeper#"))
            seen["keeper_blocks"] = list(keeper.block_ids)
            aborter = threading.Thread(target=engine.abort, args=("victim",))
            aborter.start()
            aborter.join()  # the abort call has returned before the step computes anything
            seen["aborted"] = True
        try:
            return real_execute(batch)
        except Exception as error:
            seen["fault"] = error
            raise

    core.runner.execute = execute_aborting_the_victim

    async def main():
        # A spacer takes blocks 1-10 and gives them back, so the keeper gets 11-16: the last.
        spacer = await engine.add_request(story_ids(tokenizer, 160, 7), SamplingParams(max_tokens=1))
        await _collect(spacer)
        keeper = await engine.add_request(keeper_prompt, keeper_params, "keeper")
        keeper_outputs = [await anext(keeper), await anext(keeper)]  # decoding now
        victim = await engine.add_request(
            story_ids(tokenizer, 64, 30), SamplingParams(max_tokens=8), "victim"
        )
        victim_tokens, victim_reasons = await _collect(victim)
        rest_tokens, rest_reasons = await _collect(keeper)
        first_tokens = [t for output in keeper_outputs for t in output.new_token_ids]
        return first_tokens + rest_tokens, rest_reasons[-1], victim_tokens, victim_reasons

    try:
        keeper_tokens, keeper_reason, victim_tokens, victim_reasons = asyncio.run(main())
        wait_idle(engine.stats)
    finally:
        engine.shutdown()
    assert seen.get("aborted") and "fault" not in seen, seen
    assert seen["keeper_blocks"][5] == num_blocks  # its 6th block, full of prompt K/V, is the last
    assert (victim_tokens, victim_reasons) == ([], ["abort"])  # ended at once, with nothing computed
    assert keeper_tokens == expected and keeper_reason == "length"


def test_keepers_tokens_survive_a_storm_of_adds_and_aborts_from_other_threads(llm, tokenizer):
    """Keepers run while 64 victims come and go on a small pool that recycles blocks (and
    preempts): some run to their end, some hang up from the event loop, and most are aborted by
    another thread, one every millisecond on average. The thread switch interval is shrunk so those
    aborts land inside steps."""
    rng = random.Random(12)
    keeper_prompts = [story_ids(tokenizer, n, offset) for n, offset in ((60, 0), (45, 17), (80, 33))]
    keeper_params = SamplingParams(max_tokens=24, **GREEDY)
    expected = [o.outputs[0].token_ids for o in llm.generate(keeper_prompts, keeper_params)]
    fates = ("finish", "hang up", "abort")
    victims = [
        (
            story_ids(tokenizer, rng.randint(4, 150), rng.randint(0, 200)),
            rng.randint(2, 24),
            rng.choices(fates, weights=(3, 1, 6))[0],
        )
        for _ in range(64)
    ]
    engine = AsyncEngine(
        EngineConfig(num_kv_blocks=32, max_num_batched_tokens=64, max_num_seqs=16, dtype="float32")
    )
    abortable: list[str] = []  # running victims fated to be aborted: changed on the loop only
    done = threading.Event()

    def abort_at_random() -> None:
        while not done.wait(rng.uniform(0, 0.002)):
            snapshot = list(abortable)
            if snapshot:
                engine.abort(rng.choice(snapshot))

    async def victim(index: int):
        prompt, max_tokens, fate = victims[index]
        await asyncio.sleep(index * 0.05)
        request_id = f"victim-{index}"
        stream = await engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), request_id)
        if fate == "abort":
            abortable.append(request_id)
        reasons = []
        try:
            async for output in stream:
                reasons.append(output.finish_reason)
                if fate == "hang up" and len(reasons) == 2:
                    await stream.aclose()  # type: ignore[attr-defined]
                    return "hung up"
            return reasons[-1]
        finally:
            if request_id in abortable:
                abortable.remove(request_id)

    async def main():
        # A spacer takes blocks 1-20 and gives them back, so the keepers' prompts fill 21-32, the
        # pool's last block included: where a table padded with -1 would write.
        await _collect(await engine.add_request(story_ids(tokenizer, 20 * 16), SamplingParams(max_tokens=1)))
        keepers = [
            await engine.add_request(prompt, keeper_params, f"keeper-{index}")
            for index, prompt in enumerate(keeper_prompts)
        ]
        return await asyncio.gather(
            asyncio.gather(*(_collect(stream) for stream in keepers)),
            asyncio.gather(*(victim(i) for i in range(len(victims)))),
        )

    aborter = threading.Thread(target=abort_at_random)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    aborter.start()
    try:
        keeper_results, victim_ends = asyncio.run(main())
        done.set()
        aborter.join()
        wait_idle(engine.stats)
        preemptions = engine.stats().num_preemptions
    finally:
        done.set()
        sys.setswitchinterval(switch_interval)
        engine.shutdown()
    assert [tokens for tokens, _ in keeper_results] == expected
    assert all(reasons[-1] == "length" for _, reasons in keeper_results)
    assert set(victim_ends) <= {"abort", "length", "stop", "hung up"} and "abort" in victim_ends, victim_ends
    ends = {end: victim_ends.count(end) for end in set(victim_ends)}
    print(f"victim ends: {ends}, preemptions: {preemptions}")
