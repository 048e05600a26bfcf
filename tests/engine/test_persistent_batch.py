"""The model runner's persistent batch, without a model: fed only diffs, it holds what the
scheduler would have sent whole."""

from __future__ import annotations

import torch

from common.sampling_params import SamplingParams
from replica_engine.kv_cache_manager import NULL_BLOCK_ID
from replica_engine.persistent_batch import PersistentBatch
from replica_engine.scheduler.plan import (
    PLACEHOLDER_TOKEN_ID,
    SamplingRow,
    ScheduledBatch,
    ScheduledRow,
    TokenHistory,
)

PENALIZED = SamplingRow(SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5))


def _row(request_id: str, start: int, blocks: tuple[int, ...], offset: int, history=None) -> ScheduledRow:
    return ScheduledRow(
        request_id, (1,), start, blocks, True, PENALIZED, block_offset=offset, history=history
    )


def test_new_blocks_extend_a_held_row_and_a_resumed_request_starts_afresh():
    rows = PersistentBatch(max_num_seqs=2, max_num_tokens=32, block_size=4, vocab_size=8)
    rows.apply(ScheduledBatch((_row("a", 3, (5,), 0, TokenHistory((2,), (1, 1))),)))
    rows.take_sampled(["a"], torch.tensor([3]))
    rows.apply(ScheduledBatch((_row("a", 4, (7,), 1),)))  # its second block only
    batch = ScheduledBatch((_row("a", 5, (), 2),))
    assert rows.block_tables(batch).tolist() == [[5, 7]]
    counts = rows.output_counts("a")
    assert counts is not None and counts.tolist() == [0, 2, 0, 1, 0, 0, 0, 0]
    seen = rows.prompt_seen("a")
    assert seen is not None and seen.nonzero().flatten().tolist() == [2]
    # Preempted: released, then back at offset 0 with its whole table and history.
    rows.apply(ScheduledBatch((_row("b", 0, (9,), 0),), released_request_ids=("a",)))
    assert not rows.holds("a") and rows.num_held == 1
    resumed = ScheduledBatch((_row("a", 4, (6, 8), 0, TokenHistory((2,), (1, 1, 3))),))
    rows.apply(resumed)
    assert rows.block_tables(resumed).tolist() == [[6, 8]]
    counts = rows.output_counts("a")
    assert counts is not None and counts.tolist() == [0, 2, 0, 1, 0, 0, 0, 0]


def test_applying_a_batch_again_changes_nothing():
    # A failed batch's rows are rerun one by one: each carries the same diff again.
    rows = PersistentBatch(max_num_seqs=2, max_num_tokens=32, block_size=4, vocab_size=8)
    rows.apply(ScheduledBatch((_row("a", 0, (3, 4), 0, TokenHistory((), (5,))),)))
    batch = ScheduledBatch((_row("a", 8, (6,), 2),))
    rows.apply(batch)
    rows.apply(batch)
    wide = ScheduledBatch((_row("a", 15, (), 3),))
    assert rows.block_tables(wide).tolist() == [[3, 4, 6, NULL_BLOCK_ID]]
    counts = rows.output_counts("a")
    assert counts is not None and torch.equal(counts, torch.eye(8)[5])


def test_released_rows_are_reused_and_a_row_without_its_start_is_refused():
    rows = PersistentBatch(max_num_seqs=1, max_num_tokens=8, block_size=4, vocab_size=8)
    rows.apply(ScheduledBatch((_row("a", 0, (3,), 0),)))
    rows.apply(ScheduledBatch((_row("b", 0, (4,), 0),), released_request_ids=("a",)))
    assert rows.holds("b") and rows.num_held == 1
    try:
        rows.apply(ScheduledBatch((_row("c", 4, (5,), 1),)))
    except KeyError as error:
        assert "request c" in str(error)
    else:
        raise AssertionError("a row at offset 1 for a request the runner never held was taken")


def test_a_placeholder_takes_its_requests_latest_sampled_token():
    # Async scheduling: a row sealed while its request's token was still being sampled.
    rows = PersistentBatch(max_num_seqs=3, max_num_tokens=32, block_size=4, vocab_size=8)
    rows.take_sampled(["a", "b"], torch.tensor([6, 2]))
    rows.take_sampled(["c", "a"], torch.tensor([5, 7]))  # a's latest is now 7
    batch = ScheduledBatch(
        (
            ScheduledRow("p", (3, 4, 1), 0, (9,), False, None),  # a prompt chunk: known tokens
            ScheduledRow("a", (PLACEHOLDER_TOKEN_ID,), 9, (), True, None, block_offset=3),
            ScheduledRow("b", (PLACEHOLDER_TOKEN_ID,), 4, (), True, None, block_offset=1),
        )
    )
    input_ids = torch.tensor([3, 4, 1, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID])
    rows.fill_placeholders(batch, input_ids)
    assert input_ids.tolist() == [3, 4, 1, 7, 2]
    rows.release(["a"])
    try:
        rows.fill_placeholders(batch, input_ids)
    except KeyError as error:
        assert "a" in str(error)
    else:
        raise AssertionError("a released request's placeholder was filled")
