"""Python's cyclic garbage collector held back where a save or a load makes hundreds of
thousands of small objects that form no cycles (plans, items, results, metadata records): each
full collection then walks the whole heap, holding the GIL, and frees nothing.

One rule for every shape: what is held back is given back only by whoever held it back, and
left alone where the application had switched it off itself before (a switch the application
makes during a pause cannot be told from ours: the collector is on again after it).

- :class:`gc_paused`, the collector off for a block of our own code;
- :class:`CallPause`, one DCP call, from the storage layer's first planning hook to its last,
  so that DCP's own planning between our hooks is covered too. On the caller's main thread (a
  synchronous save, a load) the collector is off; in an asynchronous save's background thread,
  beside the training loop, only full collections are deferred (young ones go on, so the
  loop's short-lived cycles are still freed; the heap walks that would stall the loop's thread
  on the GIL are not made). DCP can abandon the call between two hooks (its planner raises):
  nothing of ours runs then, so a call's pause also ends by itself after ``limit_s`` seconds,
  and the next call's pause of the same kind takes it over.

Switching the collector back on (:func:`_switch_on`) moves what was made while it was off to
the oldest generation at once, so that no young collection right after walks every object the
pause made, and then again one generation up, before the next full collection finds them (the
deadline's thread only switches it on). A forked child (a data loader's worker) gets back
whatever its parent held at the fork: no deadline runs there.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading

# How long a call's pause may last at most: far beyond the planning of a million items between
# two of our hooks (a pause that ends early only costs speed), short enough that a call DCP
# abandoned leaves the collector held back only briefly.
CALL_PAUSE_LIMIT_S = 20.0
# The oldest generation's threshold while full collections are deferred (a count of young
# collections no call reaches).
DEFERRED_THRESHOLD = 1 << 30


def _switch_on() -> None:
    """Switch the collector on, the objects made while it was off moved to the oldest generation
    without a walk (``gc.freeze`` then ``gc.unfreeze``: two list splices). Not where the
    application froze objects itself: unfreezing would give them back to the collector."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
    gc.enable()


class gc_paused:
    """Pause the cyclic garbage collector for a block, restoring its state after."""

    def __enter__(self):
        self._was_enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc):
        if self._was_enabled:
            _switch_on()
        return False


def main_thread_gc_paused():
    """:class:`gc_paused` on the main thread, nothing elsewhere: a save or load on another thread
    runs beside the caller's loop and must not switch the collector off for it (its
    :class:`CallPause` defers full collections there)."""
    return gc_paused() if threading.current_thread() is threading.main_thread() else contextlib.nullcontext()


# The two ways a call holds collections back: (hold, give back). ``hold`` returns what
# ``give back`` needs, or None where there is nothing to hold back.


def _hold_all():
    if not gc.isenabled():
        return None
    gc.disable()
    return True


def _give_all(_token, from_timer: bool = False) -> None:
    if from_timer:
        gc.enable()  # the moving of young objects is left to calls of ours, not a timer's thread
    else:
        _switch_on()


def _hold_full():
    t0, t1, t2 = gc.get_threshold()
    if not gc.isenabled() or t2 >= DEFERRED_THRESHOLD:
        return None
    gc.set_threshold(t0, t1, DEFERRED_THRESHOLD)
    return t2


def _give_full(t2: int, from_timer: bool = False) -> None:
    t0, t1, now = gc.get_threshold()
    if now == DEFERRED_THRESHOLD:  # else the application set its own since
        gc.set_threshold(t0, t1, t2)


_KINDS = {"all": (_hold_all, _give_all), "full": (_hold_full, _give_full)}
_lock = threading.Lock()
_current: dict[str, CallPause] = {}  # of each kind, the pause that holds it, if any


class CallPause:
    """Collections held back from :meth:`begin` until :meth:`end`, the deadline, or the next
    call's pause of the same kind, whichever comes first. Ending twice is harmless."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._token = None  # what giving back needs; None: this pause holds nothing
        self._timer: threading.Timer | None = None

    @classmethod
    def begin(cls, limit_s: float | None = None) -> CallPause:
        """For a call on the current thread: the collector off on the main thread, full
        collections deferred on any other (a call beside the caller's loop)."""
        kind = "all" if threading.current_thread() is threading.main_thread() else "full"
        limit_s = CALL_PAUSE_LIMIT_S if limit_s is None else limit_s
        pause = cls(kind)
        hold, _give = _KINDS[kind]
        with _lock:
            previous = _current.pop(kind, None)
            if previous is not None:  # an abandoned call's pause: this one takes its hold over
                pause._token, previous._token = previous._token, None
                previous._cancel_timer()
            else:
                pause._token = hold()
            if pause._token is not None:  # only a pause that holds something is the holder
                _current[kind] = pause
                pause._timer = threading.Timer(limit_s, pause._expire)
                pause._timer.daemon = True
                pause._timer.name = "dcpds-gc-pause"
                pause._timer.start()
        return pause

    @property
    def active(self) -> bool:
        return self._token is not None

    def end(self) -> None:
        self._give_back(from_timer=False)
        self._cancel_timer()

    def _expire(self) -> None:
        self._give_back(from_timer=True)

    def _give_back(self, from_timer: bool) -> None:
        with _lock:
            if _current.get(self.kind) is self:
                del _current[self.kind]
            token, self._token = self._token, None
            if token is not None:
                _KINDS[self.kind][1](token, from_timer)

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()


def _after_fork_in_child() -> None:
    """The child of a fork has no deadline thread: what the parent held is given back now."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    held = list(_current.values())
    _current.clear()
    for pause in held:
        token, pause._token = pause._token, None
        pause._timer = None
        if token is not None:
            _KINDS[pause.kind][1](token, True)


os.register_at_fork(after_in_child=_after_fork_in_child)
