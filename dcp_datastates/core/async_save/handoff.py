"""The asynchronous hand-off: from ``stage()`` to the save that writes the snapshot.

``DataStatesWriter.stage()`` captures a :class:`Snapshot` (its tensors placed
in the rank's file and streaming through the engine), gives it a ticket in
the order of saves, and returns its :class:`StagingFuture` at once. A writer
keeps the snapshots it staged until their saves end (:class:`WriterSnapshots`).
DCP's ``async_save`` gives that future to a thread of its own, which takes
the staged state dict from it (``result()``) and then runs ``dcp.save`` on
the writer. The hand-off is explicit at every step, with no look at DCP's
stack or heap:

* **completion**: one daemon thread (the staging monitor) waits for each
  snapshot's copies in the engine, in staging order, checks the version
  counters and resolves the future. A failed snapshot still resolves it (the
  caller may mutate its tensors again); the failure is raised by the save, on
  this rank, so DCP fails the checkpoint on every rank instead of leaving the
  others waiting in a collective;
* **pairing**: the thread that takes the future's result runs that
  snapshot's save (``Snapshot.take``); when a save begins on the writer, the
  writer hands it the oldest snapshot that thread took (FIFO per writer).
  Done-callbacks (DCP forwards completion to ``staging_completion`` with
  one) take nothing;
* **ending**: the save ends with the thread that runs it (see :mod:`order`);
* **abandoning**: a snapshot whose save will never run is given up
  explicitly: by ``writer.close()`` after the with-block failed, by
  ``writer.abandon_unbegun()`` (the manager's error path), at interpreter
  exit, when the thread that took it ended without beginning its save, or
  when nothing holds its future any more (``dcp.async_save`` raised after
  staging and dropped it) and no thread took it.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from concurrent.futures import Future

from dcp_datastates.core.async_save.runtime import runtime
from dcp_datastates.core.async_save.snapshot import Snapshot
from dcp_datastates.errors import CheckpointError
from dcp_datastates.native.gc_pause import gc_paused

_in_callback = threading.local()


class StagingFuture(Future):
    """The future ``stage()`` returns: resolved with the staged state dict once every byte of
    the snapshot has left the caller's tensors.

    It holds its snapshot; the snapshot holds it only weakly, so that a future
    nobody holds any more (and no thread took) abandons its snapshot at once.
    """

    def __init__(self, snap: Snapshot) -> None:
        super().__init__()
        self.snapshot = snap
        snap.future_ref = weakref.ref(self, _dropped_callback(snap))

    def result(self, timeout=None):
        if not getattr(_in_callback, "depth", 0):
            self.snapshot.take(threading.current_thread())
        return super().result(timeout)

    def add_done_callback(self, fn) -> None:
        super().add_done_callback(_as_callback(fn))


def _as_callback(fn):
    """``fn`` run as a done-callback: a ``result()`` inside it takes nothing."""

    def run(future) -> None:
        _in_callback.depth = getattr(_in_callback, "depth", 0) + 1
        try:
            fn(future)
        finally:
            _in_callback.depth -= 1

    return run


def _dropped_callback(snap: Snapshot):
    """The weakref callback of a staging future: it may run inside any allocation of any thread
    (a garbage collection), so it only queues the abandonment for the monitor's thread."""

    def dropped(_ref) -> None:
        if snap.taker is None:
            runtime().monitor.call_soon(lambda: snap.taker is None and snap.abandon(
                "nothing holds its staging future any more: the dcp.async_save that staged it failed"
            ))

    return dropped


def _resolve(snap: Snapshot) -> None:
    future = snap.future_ref()
    if future is None or future.done():
        return
    if snap.abandoned:
        future.set_exception(CheckpointError(f"the snapshot staged into {snap.directory} was given up: {snap.abandoned}"))
    else:
        future.set_result(snap.staged_dict)


def start(snap: Snapshot) -> StagingFuture:
    """Hand a captured snapshot (with its ticket) to the staging monitor; return its future."""
    future = StagingFuture(snap)
    rt = runtime()
    rt.track(snap)

    def complete() -> None:
        snap.await_staged()
        _resolve(snap)

    rt.monitor.call_soon(complete)
    return future


class WriterSnapshots:
    """The snapshots one writer staged whose saves have not ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshots: collections.deque[Snapshot] = collections.deque()

    def stage(self, snap: Snapshot, state_dict, engine, direct_io: str) -> StagingFuture:
        """Capture ``state_dict`` into ``snap`` and start it; returns its future."""
        t0 = time.perf_counter()
        try:
            with gc_paused():  # the caller's thread: tens of thousands of small objects, no cycles
                snap.capture(state_dict, engine, direct_io)
        except BaseException:
            snap.cancel("snapshot capture failed")
            raise
        snap.ticket = runtime().order.reserve()
        snap.ticket.on_orphaned = lambda: snap.abandon("the thread that took it ended before its save began")
        with self._lock:
            self._snapshots = collections.deque(s for s in self._snapshots if not s.ticket.ended)
            self._snapshots.append(snap)
        future = start(snap)
        snap.stage_call_s = time.perf_counter() - t0
        return future

    def take_for(self, thread: threading.Thread) -> Snapshot | None:
        """The oldest snapshot ``thread`` took whose save has not begun (None: a synchronous save)."""
        with self._lock:
            return next((s for s in self._snapshots if s.taker is thread and not s.begun and not s.abandoned), None)

    def pending(self) -> list[Snapshot]:
        """The snapshots whose save has not ended (their ticket is still open)."""
        with self._lock:
            return [s for s in self._snapshots if not s.ticket.ended]

    def wait_staged(self) -> None:
        """Block until every snapshot staged so far has left the caller's tensors."""
        for snap in self.pending():
            snap.staged.wait()

    def wait_ended(self, timeout: float | None) -> bool:
        """Block until the save of every snapshot staged so far has ended (False after ``timeout``)."""
        tickets = {id(s.ticket) for s in self.pending()}
        return runtime().order.wait_ended(lambda t: id(t) in tickets, timeout)

    def abandon_unbegun(self, why: str) -> int:
        """Give up every snapshot whose save has not begun; returns how many."""
        return sum(1 for snap in self.pending() if snap.abandon(why))

    def abandon_untaken(self, why: str) -> int:
        """Give up every snapshot no thread took (no save is running it); returns how many."""
        return sum(1 for snap in self.pending() if snap.taker is None and snap.abandon(why))

    def abandon_taken_by(self, thread: threading.Thread, why: str) -> None:
        """Give up the snapshots ``thread`` took and has not begun saving."""
        for snap in self.pending():
            if snap.taker is thread:
                snap.abandon(why)
