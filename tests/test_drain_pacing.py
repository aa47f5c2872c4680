"""When the drain may start a block: never while a save runs, and not within the guard before
the next save the loop's cadence predicts (a fake clock; the waits are real condition waits)."""

from __future__ import annotations

import threading
import time

import pytest

from dcp_datastates.tiers.drain_pacing import MAX_GUARD_S, MIN_GUARD_S, DrainPacer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _saving_every(clock: FakeClock, *intervals: float) -> DrainPacer:
    """A pacer that saw a save now, then one after each interval (the clock ends at the last)."""
    pacer = DrainPacer(clock)
    pacer.save_started()
    for dt in intervals:
        clock.now += dt
        pacer.save_started()
    return pacer


def _waiting(pacer: DrainPacer) -> threading.Event:
    """A drain thread waiting for a gap; the event is set once it may go on."""
    done = threading.Event()
    threading.Thread(target=lambda: (pacer.wait_for_gap(), done.set()), daemon=True).start()
    return done


def _returns_within(pacer: DrainPacer, seconds: float) -> bool:
    return _waiting(pacer).wait(seconds)


def test_without_a_cadence_the_drain_only_waits_for_saves():
    clock = FakeClock()
    pacer = DrainPacer(clock)
    assert pacer.next_save() is None
    assert _returns_within(pacer, 1.0)
    pacer.save_started()
    pacer.set_saving(True)
    done = _waiting(pacer)
    assert not done.wait(0.2)  # a save runs: the drain holds
    pacer.set_saving(False)
    assert done.wait(1.0)


def test_the_guard_before_the_next_expected_save():
    clock = FakeClock()
    pacer = _saving_every(clock, 2.0, 2.0, 2.0)  # a save every 2 s
    due, guard = pacer.next_save()
    assert due == pytest.approx(clock.now + 2.0) and guard == pytest.approx(0.1)
    clock.now = due - 0.5  # well before it: go on
    assert _returns_within(pacer, 1.0)
    clock.now = due - 0.05  # within the guard: wait for the save
    done = _waiting(pacer)
    assert not done.wait(0.05)
    pacer.save_started()  # it came; the next one is due 2 s after it
    assert done.wait(1.0)


def test_a_late_save_stops_holding_the_drain():
    clock = FakeClock()
    pacer = _saving_every(clock, 1.0)
    due, guard = pacer.next_save()
    assert guard == pytest.approx(max(MIN_GUARD_S, 0.05))
    clock.now = due + guard  # a guard late: the loop's cadence changed
    assert _returns_within(pacer, 1.0)


def test_the_guard_is_bounded():
    clock = FakeClock()
    pacer = _saving_every(clock, 0.01)
    assert pacer.next_save()[1] == MIN_GUARD_S
    for _ in range(2):
        clock.now += 3600
        pacer.save_started()
    assert pacer.next_save()[1] == MAX_GUARD_S


def test_a_wait_within_the_guard_ends_at_its_end_on_a_real_clock():
    pacer = DrainPacer()
    pacer.save_started()
    time.sleep(0.4)
    pacer.save_started()  # the next save is due 0.4 s from now, with a 20 ms guard
    due, guard = pacer.next_save()
    time.sleep(max(0.0, due - guard - time.monotonic()) + 0.005)
    t = time.monotonic()
    pacer.wait_for_gap()  # no save comes: it waits out the guard on both sides, then goes on
    assert time.monotonic() >= due + guard - 0.001
    assert time.monotonic() - t < 0.5
