"""Process-wide ordering of checkpoint saves.

``dcp.async_save`` runs each save's planning and commit (with their
collectives) in a new background thread. Two saves whose background threads
overlap would issue collectives on the same process group in an order that
can differ between ranks, and hang. DataStatesWriter therefore serializes
saves in this process: every save takes a ticket in program order (at
``stage()`` for asynchronous saves, when ``dcp.save`` starts otherwise), and
a save may begin its collectives only once every earlier ticket has begun
(or was abandoned) and the previous save's thread has left DCP's save
function. Program order is the same on every rank, so the order is too.

A forked child starts with an empty order: the parent's saves run (and
settle their tickets) in the parent only, so the child must not wait for them.
"""

from __future__ import annotations

import os
import sys
import threading
import time

_POLL_S = 0.002


def _inside_dcp_save(thread: threading.Thread) -> bool:
    """Whether ``thread`` is still executing DCP's ``_save_state_dict``.

    A save's last collective (the broadcast of the commit's outcome) runs in
    DCP's code after the writer's last call, so the writer cannot observe its
    end directly; the thread's stack can.
    """
    if not thread.is_alive():
        return False
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_save_state_dict" and code.co_filename.endswith("state_dict_saver.py"):
            return True
        frame = frame.f_back
    return False


class SaveSequencer:
    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """No tickets; also a fork child's start (the parent's tickets settle in the parent)."""
        self._cv = threading.Condition()
        self._next_ticket = 0
        self._settled: set[int] = set()  # tickets that began their save or were abandoned
        self._floor = 0  # every ticket below this is settled
        self._last: tuple[threading.Thread, int] | None = None  # the last save begun: thread, ticket
        self._latest_ticket: dict[int, int] = {}  # thread ident -> ticket of its latest begin()

    def reserve(self) -> int:
        with self._cv:
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def wait_turn(self, ticket: int, timeout: float | None = None) -> bool:
        """Block until every ticket before ``ticket`` has begun its save or was abandoned."""
        with self._cv:
            return self._cv.wait_for(lambda: self._floor >= ticket, timeout)

    def abandon(self, ticket: int) -> None:
        """The save of ``ticket`` will never begin (its snapshot was dropped)."""
        with self._cv:
            self._settle(ticket)

    def begin(self, ticket: int) -> None:
        """Called by the thread about to run the save of ``ticket``, before any collective."""
        me = threading.current_thread()
        with self._cv:
            if len(self._latest_ticket) > 64:  # executor threads come and go
                alive = {t.ident for t in threading.enumerate()}
                self._latest_ticket = {k: v for k, v in self._latest_ticket.items() if k in alive}
            self._latest_ticket[me.ident] = ticket
        self.wait_turn(ticket)
        with self._cv:
            previous, self._last = self._last, (me, ticket)
            self._settle(ticket)
        if previous is not None:
            self.wait_idle(*previous)

    def wait_idle(self, thread: threading.Thread | None, ticket: int | None = None) -> None:
        """Block until ``thread`` (another thread) has left DCP's save of ``ticket``.

        A thread that has begun a later save has left the earlier one (a thread
        runs its saves one after another), even though it is inside DCP's save
        function again: without this a caller's ``dcp.save`` issued while an
        earlier ``dcp.async_save`` had not begun would wait for that save, and
        that save for it.
        """
        if thread is None or thread is threading.current_thread():
            return
        while _inside_dcp_save(thread):
            if ticket is not None and self._latest_ticket.get(thread.ident, ticket) != ticket:
                return
            time.sleep(_POLL_S)

    def _settle(self, ticket: int) -> None:
        self._settled.add(ticket)
        while self._floor in self._settled:
            self._settled.discard(self._floor)
            self._floor += 1
        self._cv.notify_all()


SEQUENCER = SaveSequencer()

# Reset in place: writer and snapshot hold this very object. A fresh condition
# too, since another thread of the parent may have held its lock at the fork.
os.register_at_fork(after_in_child=SEQUENCER._reset)
