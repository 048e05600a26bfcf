"""The replicas' block summaries (common/block_summary.py), on random keys: no false negatives
and the false-positive rate the docs state (measured)."""

from __future__ import annotations

import random

import pytest

from common.block_summary import BlockSummary


def _keys(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def test_a_4096_block_summary_at_one_percent_is_4_8_kib_and_seven_probes():
    summary = BlockSummary.of([], capacity=4096)
    assert (summary.num_bits, summary.num_probes) == (39264, 7)
    assert len(summary.bits) == 4908


# At capacity, the stated 1%; a pool twice the capacity: (1 - e^(-7 * 8192 / 39264))^7 = 15.8%.
@pytest.mark.parametrize(("num_keys", "stated"), [(4096, 0.01), (8192, 0.158)])
def test_held_keys_are_always_found_and_false_positives_match_the_formula(num_keys, stated):
    held = _keys(num_keys, seed=1)
    summary = BlockSummary.of(held, capacity=4096)
    assert summary.contains_each(held).all()  # no false negatives, even past capacity
    strangers = _keys(50_000, seed=2)
    measured = summary.contains_each(strangers).mean()
    expected = summary.false_positive_rate(num_keys)
    assert expected == pytest.approx(stated, rel=0.05)
    assert measured == pytest.approx(expected, rel=0.15), (measured, expected)


def test_bad_geometry_is_refused():
    with pytest.raises(ValueError):
        BlockSummary.of([], capacity=0)
    with pytest.raises(ValueError):
        BlockSummary.of([], capacity=10, false_positive_rate=1.5)


def test_one_key_at_a_time_answers_as_the_batch_does():
    # `in` probes in plain Python (the router's first-block check), contains_each in numpy: one filter.
    summary = BlockSummary.of(_keys(4096, seed=1), capacity=4096)
    keys = _keys(2000, seed=1)[:1000] + _keys(20_000, seed=3)
    batch = summary.contains_each(keys)
    assert [key in summary for key in keys] == batch.tolist()
    assert batch[:1000].all() and 0 < batch[1000:].sum() < 1000  # held ones, and a few false positives
