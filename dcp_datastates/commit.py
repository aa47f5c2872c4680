"""Durable file operations for the commit protocol.

A checkpoint is committed by the appearance of ``.metadata``. Everything it
refers to must be on disk before that name exists, so the order is: data and
index files fsynced (by each rank), the directory fsynced (their names are
durable), the metadata written to a temporary name and fsynced, renamed into
place, and the directory fsynced again (the rename is durable).

Each operation passes through the engine's fault-injection rules (armed only
by tests, see :mod:`_faults`), so crash and disk-full tests reach every step.
"""

from __future__ import annotations

import os

from ._native import _engine

_WRITE, _FSYNC, _RENAME = 0, 2, 3


def _fault_point(op: int, path: str, offset: int = 0, nbytes: int = 0) -> int:
    """How many bytes the next transfer may move (all unless a test armed a fault)."""
    if not _engine._faults_armed():
        return nbytes
    return _engine._fault_point(op, path, offset, nbytes)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _fault_point(_FSYNC, path)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file_durably(path: str, data: bytes | memoryview) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync it.

    On failure (a full disk, an I/O error) the partial file is removed.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            want = _fault_point(_WRITE, path, done, len(view) - done)
            done += os.write(fd, view[done : done + want])
        _fault_point(_FSYNC, path)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        remove_if_present([path])
        raise
    os.close(fd)


def rename_into_place(tmp_path: str, final_path: str, directory: str) -> None:
    """Atomically rename ``tmp_path`` to ``final_path`` once the directory's entries are durable.

    The caller fsyncs the directory again afterwards (the rename itself is
    durable then). Once the rename has happened the checkpoint is committed:
    an error after it must never remove the files ``final_path`` refers to.
    """
    fsync_dir(directory)
    _fault_point(_RENAME, final_path)
    os.replace(tmp_path, final_path)


def remove_if_present(paths) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
