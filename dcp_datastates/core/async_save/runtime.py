"""What the asynchronous saves of one process share, and what a fork child starts without.

One :class:`AsyncSaveRuntime` per process, made on first use, owns the order
of saves, the errors of background saves not yet raised, the snapshots
alive, the staging monitor (the thread that completes snapshots), the
process-wide fence's hook and the writers alive. A forked child inherits all
of it but none of the threads that move it, and the parent's saves end (and
report their errors) in the parent only: the one fork hook here gives the
child an empty order, no errors, no snapshots, a new monitor and new locks,
and tells every writer to forget the parent's saves.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import threading
import weakref
from typing import Callable, Protocol

from dcp_datastates.core.async_save.order import SaveOrder
from dcp_datastates.errors import CheckpointError


class Snapshot(Protocol):
    """What the runtime needs of a snapshot it tracks (:class:`snapshot.Snapshot`, which imports
    this module: the runtime names only this interface)."""

    begun: bool
    abandoned: str | None  # why, once abandoned
    staged: threading.Event

    def abandon(self, why: str) -> bool: ...


class BackgroundErrors:
    """Errors of asynchronous saves not yet raised to the caller.

    A background save's error fails its upload future; it is raised once more
    by the next save call in the process (``stage()`` or a synchronous save),
    so a training loop that never looks at its futures still learns of it,
    and ``writer.close()`` raises the errors of that writer's saves. Writers are
    told apart by a serial number (``id()`` values are reused).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[tuple[int, str, BaseException]] = []

    def record(self, writer_serial: int, path: str, exc: BaseException) -> None:
        with self._lock:
            self._errors.append((writer_serial, path, exc))

    def drain(self) -> list[tuple[int, str, BaseException]]:
        """Remove and return every unreported error (tests check that none leaked)."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def raise_first(self, writer_serial: int | None = None) -> None:
        """Raise (once) the first unreported error, of any writer or of ``writer_serial``'s."""
        with self._lock:
            mine = [e for e in self._errors if writer_serial is None or e[0] == writer_serial]
            for e in mine:
                self._errors.remove(e)
        if mine:
            _, path, exc = mine[0]
            more = f" ({len(mine) - 1} more failed too)" if len(mine) > 1 else ""
            raise CheckpointError(f"an earlier asynchronous save to {path} failed{more}: {exc}") from exc


_serials = itertools.count(1)  # never reset: a writer made before a fork keeps its serial


def new_writer_serial() -> int:
    return next(_serials)


class StagingMonitor:
    """One daemon thread that runs what it is given, in order: each snapshot's completion (so that
    staging futures resolve in staging order) and the abandonment of dropped snapshots."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._in_hand = 0  # calls queued and not finished

    def call_soon(self, fn: Callable[[], object]) -> None:
        with self._idle:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dcp_datastates-staging", daemon=True)
                self._thread.start()
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
        """Block until every call queued so far has run (False after ``timeout`` seconds)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_hand == 0, timeout)


class AsyncSaveRuntime:
    """The process's asynchronous-save state. Read its parts through :func:`runtime` at each use:
    a fork child replaces them."""

    def __init__(self) -> None:
        self.writers: weakref.WeakSet = weakref.WeakSet()  # DataStatesWriters alive
        self.fence_hook = None  # torch's handle of the global fence's hook, while anyone holds it
        self.fence_holders = 0  # GlobalFenceHandles not yet removed
        self._start_empty()

    def _start_empty(self) -> None:
        self.order = SaveOrder()
        self.errors = BackgroundErrors()
        self.monitor = StagingMonitor()
        # Reentrant: a fence holder may let go from a __del__ that a collection runs inside
        # install_global_fence.
        self.fence_lock = threading.RLock()
        self._live_lock = threading.Lock()
        self._live: set[Snapshot] = set()  # captured, neither ended nor abandoned

    def after_fork_in_child(self) -> None:
        """The parent's saves go on in the parent only; another of its threads may have held any
        lock at the fork. The global fence's hook stays installed, held by the same handles."""
        self._start_empty()
        for writer in list(self.writers):
            writer._forget_parent_saves()

    # -- snapshots alive in this process ------------------------------------------------

    def track(self, snap: Snapshot) -> None:
        with self._live_lock:
            self._live.add(snap)

    def forget(self, snap: Snapshot) -> None:
        with self._live_lock:
            self._live.discard(snap)

    def unbegun(self) -> list[Snapshot]:
        """Snapshots whose save has not begun (and that were not abandoned)."""
        with self._live_lock:
            return [s for s in self._live if not s.begun and not s.abandoned]

    def staging_in_flight(self) -> list[Snapshot]:
        """Snapshots still copying out of the caller's tensors (the fence waits for these)."""
        with self._live_lock:
            return [s for s in self._live if not s.staged.is_set()]


_runtime: AsyncSaveRuntime | None = None
_making = threading.Lock()


def runtime() -> AsyncSaveRuntime:
    """This process's runtime, made on first use."""
    global _runtime
    if _runtime is None:
        with _making:
            if _runtime is None:
                _runtime = AsyncSaveRuntime()
    return _runtime


def _after_fork_in_child() -> None:
    global _making
    _making = threading.Lock()
    if _runtime is not None:
        _runtime.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _abandon_unbegun_at_exit() -> None:
    """At interpreter exit: give up the snapshots whose save never began.

    Python has joined every non-daemon thread by then (DCP's save threads
    too), so no save can begin any more; a snapshot staged and never saved is
    all that can remain. Stopping its engine job lets the monitor (a daemon
    thread) leave the engine's wait: were it still blocked there when the
    interpreter finalizes, it would be unwound through C++ frames and the
    process aborted (SIGABRT).
    """
    if _runtime is None:
        return
    for snap in _runtime.unbegun():
        snap.abandon("the interpreter exited before its save began")
    _runtime.monitor.wait_idle(timeout=10.0)


atexit.register(_abandon_unbegun_at_exit)
