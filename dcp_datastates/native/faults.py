"""Fault injection for the reliability tests: make chosen file operations fail.

The rules live in the native engine, so they hit the engine's own writes,
reads and fsyncs, and the Python side of a save (rank index, metadata,
renames, directory fsyncs) passes through the same rules via
:func:`checkpoint` calls in :mod:`commit`. Nothing is armed unless a test
arms it; while nothing is, each I/O call pays one atomic load.

    with inject_fault("write", path="rank00000", offset=1 << 20, errno=errno.ENOSPC):
        dcp.save(state, storage_writer=DataStatesWriter(path))   # fails, naming the file

Actions: ``"error"`` (the bytes before ``offset`` are written, then the call
fails with ``errno``, as a disk that fills mid-write does), ``"short"`` (the
call moves fewer bytes than asked; correct callers retry) and ``"kill"`` (the
bytes before ``offset`` are written, then the process dies by SIGKILL).
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
from typing import Iterator

from dcp_datastates.native.engine import _engine

_ANY_OFFSET = (1 << 64) - 1  # the engine's kAnyOffset
OPS = {"write": 0, "read": 1, "fsync": 2, "rename": 3}
ACTIONS = {"error": 0, "short": 1, "kill": 2}
_count = 0  # rules armed since the last clear(): the next rule's index


def arm(
    op: str,
    *,
    path: str = "",
    offset: int | None = None,
    action: str = "error",
    errno: int = errno_codes.EIO,
    skip: int = 0,
    times: int = 1,
) -> int:
    """Add a rule; returns its index (for :func:`fired`).

    A write or read rule fires on the call whose bytes contain ``offset``
    (``None``: on every call); ``times=-1`` fires on every match.
    """
    if op not in OPS:
        raise ValueError(f"fault op must be one of {sorted(OPS)}, got {op!r}")
    if action not in ACTIONS:
        raise ValueError(f"fault action must be one of {sorted(ACTIONS)}, got {action!r}")
    where = _ANY_OFFSET if offset is None else int(offset)
    _engine._fault_add(OPS[op], path, where, ACTIONS[action], int(errno), int(skip), int(times))
    global _count
    _count += 1
    return _count - 1


def clear() -> None:
    """Remove every rule."""
    global _count
    _engine._fault_clear()
    _count = 0


def fired(rule_index: int) -> int:
    """How many times rule ``rule_index`` has fired."""
    return _engine._fault_fired(rule_index)


@contextlib.contextmanager
def inject_fault(op: str, **rule) -> Iterator[int]:
    """Arm one rule for the duration of the block (every rule is cleared on exit)."""
    index = arm(op, **rule)
    try:
        yield index
    finally:
        clear()


