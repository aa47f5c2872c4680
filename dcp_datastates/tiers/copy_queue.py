"""The queue of a tier whose copies run in a background thread of the training process (the
durable tier, the partner level): each step's status, the copies not ended yet, the failures
not raised yet, and the thread's priority."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

from dcp_datastates.format.checkpoint_layout import RankFiles
from dcp_datastates.tiers.drain import DrainError

QUEUED, DRAINING, DURABLE, FAILED, DELETED = "queued", "draining", "durable", "failed", "deleted"


@dataclasses.dataclass
class DrainStatus:
    """Where one step's copy to the durable tier stands, on this rank."""

    step: int
    # queued, draining, durable (rank 0: committed there; others: confirmed), failed, or deleted (rank 0,
    # which applies the tier's retention: the copy was durable and retention removed it since)
    state: str = QUEUED
    bytes_done: int = 0
    bytes_total: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclasses.dataclass
class DrainJob:
    """One step to copy: this rank's files of it, in the local step directory."""

    step: int
    local_dir: str
    files: RankFiles


def lower_priority() -> None:
    """The drain thread runs at the lowest CPU priority (nice 19; Linux applies it to this
    thread only): the training loop and the save's own threads come first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):  # not permitted, or not Linux: the drain still pauses for saves
        pass


class CopyQueue:
    """What every tier whose copies run in a background thread keeps: each step's status, the
    copies not ended yet, the failures not raised yet; :meth:`wait` for them (the durable tier,
    the partner level)."""

    url: str

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._status: dict[int, DrainStatus] = {}
        self._unreported: list[DrainError] = []

    def status(self) -> dict[int, DrainStatus]:
        with self._lock:
            return {s: dataclasses.replace(st) for s, st in self._status.items()}

    def _queued(self, step: int) -> None:
        """Under ``self._lock``: a copy of ``step`` joined the queue."""
        self._status[step] = DrainStatus(step)
        self._pending += 1

    def _ended(self) -> None:
        """A copy ended (either way)."""
        with self._lock:
            self._pending -= 1
            self._idle.notify_all()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every queued copy ended; raise (once) the first failure not yet raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"copies to {self.url} still running after {timeout} s")
                self._idle.wait(left)
        self.raise_errors()

    def raise_errors(self) -> None:
        with self._lock:
            errors, self._unreported = self._unreported, []
        if errors:
            raise errors[0]
