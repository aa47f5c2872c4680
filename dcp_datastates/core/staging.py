"""The asynchronous hand-off: from ``stage()`` to the save that writes the snapshot.

``DataStatesWriter.stage()`` captures a :class:`Snapshot` and returns a
:class:`StagingFuture` at once. DCP's ``async_save`` gives that future to a
thread of its own, which takes the staged state dict from it (``result()``)
and then runs ``dcp.save`` on the writer. The hand-off is explicit at every
step, with no look at DCP's stack or heap:

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
* **ending**: the save ends with the thread that runs it (see
  :mod:`save_order`);
* **abandoning**: a snapshot whose save will never run is given up
  explicitly: by ``writer.close()`` after the with-block failed, by
  ``writer.abandon_unbegun()`` (the manager's error path), at interpreter
  exit, when the thread that took it ended without beginning its save, or
  when nothing holds its future any more (``dcp.async_save`` raised after
  staging and dropped it) and no thread took it.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import weakref
from concurrent.futures import Future

from dcp_datastates.core import snapshot as snapshots
from dcp_datastates.core.snapshot import Snapshot
from dcp_datastates.errors import CheckpointError

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
            _MONITOR.call_soon(lambda: snap.taker is None and snap.abandon(
                "nothing holds its staging future any more: the dcp.async_save that staged it failed"
            ))

    return dropped


class _StagingMonitor:
    """One daemon thread that resolves staging futures, in staging order."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()  # callables, run in order
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition()
        self._in_hand = 0  # snapshots submitted and not resolved yet

    def submit(self, snap: Snapshot) -> None:
        """Resolve ``snap``'s future once its copies are done (after every earlier one)."""

        def complete() -> None:
            snap.await_staged()
            _resolve(snap)

        self.call_soon(complete)

    def call_soon(self, fn) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dcp_datastates-staging", daemon=True)
                self._thread.start()
        with self._idle:
            self._in_hand += 1
        self._q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            try:
                fn()
            finally:
                del fn  # an idle monitor holds no snapshot (and no alias of the caller's tensors)
                with self._idle:
                    self._in_hand -= 1
                    self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Block until every submitted snapshot is resolved (False after ``timeout`` seconds)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_hand == 0, timeout)


def _resolve(snap: Snapshot) -> None:
    future = snap.future_ref()
    if future is None or future.done():
        return
    if snap.abandoned:
        future.set_exception(CheckpointError(f"the snapshot staged into {snap.directory} was given up: {snap.abandoned}"))
    else:
        future.set_result(snap.staged_dict)


_MONITOR = _StagingMonitor()


def start(snap: Snapshot) -> StagingFuture:
    """Hand a captured snapshot (with its ticket) to the staging monitor; return its future."""
    future = StagingFuture(snap)
    snapshots.track(snap)
    _MONITOR.submit(snap)
    return future


def _abandon_unbegun_at_exit() -> None:
    """At interpreter exit: give up the snapshots whose save never began.

    Python has joined every non-daemon thread by then (DCP's save threads
    too), so no save can begin any more; a snapshot staged and never saved is
    all that can remain. Stopping its engine job lets the monitor (a daemon
    thread) leave the engine's wait: were it still blocked there when the
    interpreter finalizes, it would be unwound through C++ frames and the
    process aborted (SIGABRT).
    """
    for snap in snapshots.unbegun():
        snap.abandon("the interpreter exited before its save began")
    _MONITOR.wait_idle(timeout=10.0)


atexit.register(_abandon_unbegun_at_exit)


def _new_monitor_after_fork() -> None:
    """In a fork child: the parent's monitor thread and its queue (whose engine jobs run in the
    parent) stay behind; start empty."""
    global _MONITOR
    _MONITOR = _StagingMonitor()


os.register_at_fork(after_in_child=_new_monitor_after_fork)
