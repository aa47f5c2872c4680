"""Python's cyclic garbage collector paused where a save or a load makes hundreds of thousands
of small objects that form no cycles (plans, items, results, metadata records): each full
collection then walks the whole heap and frees nothing.

Two shapes, one rule (the collector is switched back on only by whoever switched it off, and
left off where the application had switched it off), and one way to switch it back on
(:func:`_switch_on`): what was made during the pause joins the oldest generation at once, so
no young collection right after walks every object the pause made, and then again one
generation up, before the next full collection finds them.

- :class:`gc_paused`, a block of our own code;
- :class:`CallPause`, one DCP call on the caller's thread, from the storage layer's first
  planning hook to its last, so that DCP's own planning between our hooks runs without
  collections too. DCP can abandon the call between two hooks (its planner raises): nothing of
  ours runs then, so the pause also ends by itself after ``limit_s`` seconds, and the next
  call's pause takes it over.
"""

from __future__ import annotations

import gc
import threading

# How long a call's pause may last at most: far beyond the planning of a million items between
# two of our hooks (a pause that ends early only costs speed), short enough that a call DCP
# abandoned leaves the collector off only briefly.
CALL_PAUSE_LIMIT_S = 20.0


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


_lock = threading.Lock()
_current: CallPause | None = None  # the pause that owns the collector's switch, if any


class CallPause:
    """The collector paused from :meth:`begin` (on the main thread only: a call on another thread
    must not switch it off for the caller's loop) until :meth:`end`, the deadline, or the next
    call's pause, whichever comes first. Ending twice is harmless."""

    def __init__(self) -> None:
        self._owns = False  # this pause switched the collector off and has not switched it on
        self._timer: threading.Timer | None = None

    @classmethod
    def begin(cls, limit_s: float | None = None) -> CallPause:
        global _current
        limit_s = CALL_PAUSE_LIMIT_S if limit_s is None else limit_s
        pause = cls()
        if threading.current_thread() is not threading.main_thread():
            return pause
        with _lock:
            previous, _current = _current, pause
            if previous is not None:  # an abandoned call's pause: this one takes its switch over
                pause._owns, previous._owns = previous._owns, False
                previous._cancel_timer()
            elif gc.isenabled():
                gc.disable()
                pause._owns = True
            if pause._owns:
                pause._timer = threading.Timer(limit_s, pause.end)
                pause._timer.daemon = True
                pause._timer.name = "dcpds-gc-pause"
                pause._timer.start()
        return pause

    @property
    def active(self) -> bool:
        return self._owns

    def end(self) -> None:
        global _current
        with _lock:
            if _current is self:
                _current = None
            owned, self._owns = self._owns, False
            if owned:
                _switch_on()
        self._cancel_timer()

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
