"""Fault injection for the reliability tests: make chosen file operations fail.

The rules live in the native engine, so they hit the engine's own writes,
reads and fsyncs, and the Python side of a save (rank index, metadata,
renames, directory fsyncs) passes through the same rules via
:func:`fault_point` calls in :mod:`storage.fsync_files`. The engine side is the
``faults`` submodule of the extension (``dcp_datastates._engine.faults``),
kept apart from the production API. Nothing is armed unless a test
arms it; while nothing is, each I/O call pays one atomic load.

    with inject_fault("write", path="rank00000", offset=1 << 20, errno=errno.ENOSPC):
        dcp.save(state, storage_writer=DataStatesWriter(path))   # fails, naming the file

Actions: ``"error"`` (the bytes before ``offset`` are written, then the call
fails with ``errno``, as a disk that fills mid-write does), ``"short"`` (the
call moves fewer bytes than asked; correct callers retry), ``"kill"`` (the
bytes before ``offset`` are written, then the process dies by SIGKILL) and
``"stall"`` (the call waits ``stall_s``, then goes through: a slow disk, for
what must not wait for the writes).
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
from typing import Iterator

from dcp_datastates.native.engine import _engine

_faults = _engine.faults  # the rules live in the engine: they hook its own I/O calls
OPS = {op.name: op for op in _faults.Op.__members__.values()}
ACTIONS = {action.name: action for action in _faults.Action.__members__.values()}


def _op(op: str) -> "_faults.Op":
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"fault op must be one of {sorted(OPS)}, got {op!r}") from None


def arm(
    op: str,
    *,
    path: str = "",
    offset: int | None = None,
    action: str = "error",
    errno: int = errno_codes.EIO,
    skip: int = 0,
    times: int = 1,
    stall_s: float = 0.0,
) -> int:
    """Add a rule; returns its index (for :func:`fired`).

    A write or read rule fires on the call whose bytes contain ``offset``
    (``None``: on every call); ``times=-1`` fires on every match. A ``"stall"``
    rule makes the call wait ``stall_s`` seconds first.
    """
    if action not in ACTIONS:
        raise ValueError(f"fault action must be one of {sorted(ACTIONS)}, got {action!r}")
    if (action == "stall") != (stall_s > 0):
        raise ValueError(f"stall_s (got {stall_s}) is a positive duration for a 'stall' rule only (action {action!r})")
    where = _faults.ANY_OFFSET if offset is None else int(offset)
    return _faults.add(_op(op), path, where, ACTIONS[action], int(errno), int(skip), int(times),
                       round(stall_s * 1e6))


def clear() -> None:
    """Remove every rule."""
    _faults.clear()


def fired(rule_index: int) -> int:
    """How many times rule ``rule_index`` has fired."""
    return _faults.fired(rule_index)


def fault_point(op: str, path: str, offset: int = 0, nbytes: int = 0) -> int:
    """Python-side I/O passes through the same rules: how many of ``nbytes`` the next
    transfer at ``offset`` may move (all of them unless a test armed a fault), or the
    injected ``OSError`` (or death, for ``"kill"``). For ``"fsync"`` and ``"rename"``
    only the raise matters."""
    if not _faults.armed():
        return nbytes
    return _faults.point(_op(op), path, offset, nbytes)


@contextlib.contextmanager
def inject_fault(op: str, **rule) -> Iterator[int]:
    """Arm one rule for the duration of the block (every rule is cleared on exit)."""
    index = arm(op, **rule)
    try:
        yield index
    finally:
        clear()
