"""Python's cyclic garbage collector paused while DCP plans and runs a save or a load on the
calling thread.

DCP's planners make several objects per item (write and read items, chunk and property records,
copies of the plans) that form no cycles but trigger full collections, and each full collection
walks the whole heap of a training process: with thousands of tensors a large share of a save's
or a load's CPU time goes there, and frees nothing (docs/benchmarks.md). Our hooks bracket those
steps, but DCP's own code runs between them, where an error of DCP's never reaches us. So a
pause belongs to the DCP call it was made in (its outermost frame on the caller's stack): it ends
at our last hook of that call, or, when DCP raised in between, as soon as a guard thread sees
that call gone (it looks a few times a second while a pause is in force, and exists only then).

No pause is made outside a DCP call or where the collector is off already (the application's
choice, left as it is); one thread's pause at a time. A forked child starts with the collector
on and no pause.
"""

from __future__ import annotations

import gc
import os
import sys
import threading

from dcp_datastates import _dcp_compat

GUARD_POLL_S = 0.2  # how often the guard looks whether the paused call is still running


class _Pause:
    """One pause: the thread that made it and the frame of the DCP call it serves."""

    def __init__(self, thread_id: int, frame) -> None:
        self.thread_id = thread_id
        self.frame = frame
        self.over = threading.Event()  # set when the pause ends: the guard leaves at once


_lock = threading.Lock()
_held: _Pause | None = None


def begin() -> bool:
    """Pause the collector for the DCP call that is calling us (a hook of ours); True when a
    pause of this thread is in force afterwards. The thread's next call moves its pause to
    that call (an earlier call that raised between our hooks ended without our last one)."""
    global _held
    frame = _dcp_compat.dcp_call_frame(sys._getframe(1))
    if frame is None:
        return False
    me = threading.get_ident()
    with _lock:
        if _held is not None:
            if _held.thread_id != me:
                return False  # another thread's save or load holds it
            _held.frame = frame
            return True
        if not gc.isenabled():
            return False
        gc.disable()
        pause = _held = _Pause(me, frame)
    threading.Thread(target=_guard, args=(pause,), name="dcp_datastates-gc-guard", daemon=True).start()
    return True


def end() -> None:
    """End this thread's pause (our last hook of the call, or its failure); nothing otherwise."""
    with _lock:
        if _held is not None and _held.thread_id == threading.get_ident():
            _release()


def paused() -> bool:
    """Whether a pause is in force (in any thread)."""
    return _held is not None


def _release() -> None:
    """End the pause in force (the caller holds ``_lock``)."""
    global _held
    pause, _held = _held, None
    pause.frame = None
    pause.over.set()
    if gc.get_freeze_count() == 0:  # (the application's own frozen objects are left alone)
        # What was made during the pause joins the oldest generation without being walked: a
        # collection at the next allocation would otherwise visit every object DCP still holds.
        gc.freeze()
        gc.unfreeze()
    gc.enable()


def _still_running(pause: _Pause) -> bool:
    frame = sys._current_frames().get(pause.thread_id)
    while frame is not None:
        if frame is pause.frame:
            return True
        frame = frame.f_back
    return False


def _guard(pause: _Pause) -> None:
    while not pause.over.wait(GUARD_POLL_S):
        with _lock:
            if _held is not pause:
                return
            if not _still_running(pause):
                _release()
                return


def _after_fork_in_child() -> None:
    global _held, _lock
    _lock = threading.Lock()
    if _held is not None:
        _held = None
        gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)
