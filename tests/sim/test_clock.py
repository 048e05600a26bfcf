"""The simulator's virtual clock."""

import pytest

from fleet_sim.clock import EventLoop


def test_events_run_in_time_order_and_ties_in_the_order_they_were_scheduled():
    loop, seen = EventLoop(), []
    for when, name in ((2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b")):
        loop.call_at(when, lambda name=name: seen.append((loop.now, name)))
    loop.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (2.0, "c"), (2.0, "d")]


def test_an_event_can_schedule_more_and_run_until_stops_the_clock_there():
    loop, seen = EventLoop(), []

    def tick() -> None:
        seen.append(loop.now)
        loop.call_later(0.5, tick)

    loop.call_at(0.0, tick)
    loop.run(until=1.2)
    assert seen == [0.0, 0.5, 1.0]
    assert loop.now == 1.2 and loop.num_pending == 1


def test_the_past_cannot_be_scheduled():
    loop = EventLoop()
    loop.call_at(1.0, lambda: None)
    loop.run()
    with pytest.raises(ValueError, match="when"):
        loop.call_at(0.5, lambda: None)
