"""The AsyncStager half of ``DataStatesWriter``: a writer's snapshots and their hand-off.

``stage()`` captures a :class:`Snapshot` (its tensors placed in the rank's
file and streaming through the engine), gives it a ticket in the order of
saves, and returns its :class:`StagingFuture`. A writer keeps the snapshots
it staged until their saves end, oldest first; when a save begins on the
writer, :meth:`WriterSnapshots.take_for` hands it the oldest snapshot that the
save's thread took from its future (see :mod:`staging`): FIFO per writer,
and a save never pairs with a snapshot another thread took.
"""

from __future__ import annotations

import collections
import threading
import time

from dcp_datastates.core import staging
from dcp_datastates.core.save_order import ORDER
from dcp_datastates.core.snapshot import Snapshot
from dcp_datastates.core.staging import StagingFuture
from dcp_datastates.native.engine import gc_paused


class WriterSnapshots:
    """The snapshots one writer staged whose saves have not ended."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """Empty; also a fork child's start (the parent's snapshots are saved in the parent)."""
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
        snap.ticket = ORDER.reserve()
        snap.ticket.on_orphaned = lambda: snap.abandon("the thread that took it ended before its save began")
        with self._lock:
            self._snapshots = collections.deque(s for s in self._snapshots if not s.ticket.ended)
            self._snapshots.append(snap)
        future = staging.start(snap)
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
        return ORDER.wait_ended(lambda t: id(t) in tickets, timeout)

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
