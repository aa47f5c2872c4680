"""The process-wide order of checkpoint saves.

Every save on a process group runs collectives (DCP gathers the local plans,
scatters the global plan, gathers the write results and broadcasts the
outcome). ``dcp.async_save`` runs each save in a background thread of its
own, so two saves in flight at once could issue their collectives in an
order that differs between ranks, and hang or mix up their plans. Saves are
therefore run one at a time, in program order, which is the same on every
rank:

* every save takes a :class:`Ticket` in program order: an asynchronous save
  when ``stage()`` captures its snapshot, a synchronous save when it begins;
* a save begins (before its first collective) only once every earlier ticket
  has *ended*;
* a ticket ends when its save is over on this rank:

  - a save run by one of DCP's asynchronous save threads (each runs exactly
    one save and ends with it, resolving the upload future as its last act;
    see :func:`_dcp_compat.runs_one_save`) ends when that thread has ended,
    which the next save waits for with ``Thread.join``: after DCP's last
    collective, never before;
  - any other save (``dcp.save`` in the caller's thread) ends at the writer's
    last call of that save, or when its thread begins another save or enters
    ``stage()``/``close()`` (a thread runs its saves one after another);
  - a ticket whose save will never run (its snapshot was abandoned) ends
    when it is abandoned.

Nothing here polls: waits are on a condition variable (ticket changes) or on
``Thread.join``. A forked child starts with an empty order (see :mod:`runtime`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from dcp_datastates import _dcp_compat


@dataclasses.dataclass(eq=False)
class Ticket:
    """One save's place in the order. Fields change only under the order's lock."""

    number: int
    thread: threading.Thread | None = None  # the thread that runs (or will run) the save
    began: bool = False
    ended: bool = False
    # Called (outside the lock) when the ticket's thread ended without beginning its
    # save: the snapshot it took will never be saved.
    on_orphaned: Callable[[], None] | None = None

    @property
    def bound_to_thread(self) -> bool:
        """Whether the save ends with its thread (one of DCP's per-save threads)."""
        return self.thread is not None and _dcp_compat.runs_one_save(self.thread)


class SaveOrder:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._next = 0
        self._open: dict[int, Ticket] = {}  # tickets not ended, by number

    # -- taking and assigning tickets --------------------------------------------

    def reserve(self) -> Ticket:
        """A new ticket, after every ticket taken so far."""
        with self._cv:
            ticket = Ticket(self._next)
            self._next += 1
            self._open[ticket.number] = ticket
            return ticket

    def assign(self, ticket: Ticket, thread: threading.Thread) -> None:
        """``thread`` will run the save of ``ticket`` (it took the snapshot's staged state)."""
        with self._cv:
            if ticket.thread is None and not ticket.ended:
                ticket.thread = thread
                self._cv.notify_all()

    # -- beginning and ending ----------------------------------------------------

    def begin(self, ticket: Ticket) -> None:
        """Called in the thread about to run the save of ``ticket``, before any collective:
        block until every earlier ticket has ended."""
        me = threading.current_thread()
        self.leave_saves_of(me)
        with self._cv:
            ticket.thread = me
        self.wait_ended(lambda t: t.number < ticket.number)
        with self._cv:
            ticket.began = True
            self._cv.notify_all()

    def end(self, ticket: Ticket) -> None:
        """The save of ``ticket`` is over on this rank (or will never run)."""
        with self._cv:
            if not ticket.ended:
                ticket.ended = True
                self._open.pop(ticket.number, None)
                self._cv.notify_all()

    def end_unless_bound(self, ticket: Ticket) -> None:
        """The writer's last call of a save: its end, unless its thread's end is (DCP's async thread)."""
        if not ticket.bound_to_thread:
            self.end(ticket)

    def leave_saves_of(self, thread: threading.Thread) -> None:
        """``thread`` is back outside DCP: every save it began and that is not bound to a thread
        of its own is over (a thread runs one save at a time, even when DCP failed between
        the writer's calls and the writer never saw that save's end)."""
        with self._cv:
            done = [t for t in self._open.values() if t.began and t.thread is thread and not t.bound_to_thread]
        for t in done:
            self.end(t)

    # -- waiting ------------------------------------------------------------------

    def wait_ended(self, which: Callable[[Ticket], bool], timeout: float | None = None) -> bool:
        """Block until every open ticket ``which`` selects (and no later one) has ended.

        A ticket whose save runs in a thread of its own is waited for by
        joining that thread; if the thread ended without beginning the save,
        the ticket is orphaned: its ``on_orphaned`` runs and it ends. Returns
        False if ``timeout`` (seconds, overall) passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.current_thread()
        while True:
            with self._cv:
                pending = sorted((t for t in self._open.values() if which(t)), key=lambda t: t.number)
                if not pending:
                    return True
                first = pending[0]
                joinable = first.thread if first.bound_to_thread and first.thread is not me else None
                if joinable is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cv.wait(left)
                    continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            joinable.join(left)
            if joinable.is_alive():
                return False
            with self._cv:
                orphaned = not first.began and not first.ended
            if orphaned and first.on_orphaned is not None:
                first.on_orphaned()
            self.end(first)
