"""Durable file operations for the commit protocol.

A checkpoint is committed by the appearance of ``.metadata``. Everything it
refers to must be on disk before that name exists, so the order is: data and
index files fsynced (by each rank), the directory fsynced (their names are
durable), the metadata written to a temporary name and fsynced, renamed into
place, and the directory fsynced again (the rename is durable).
"""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file_durably(path: str, data: bytes | memoryview) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync it.

    On failure (a full disk, an I/O error) the partial file is removed.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        remove_if_present([path])
        raise
    os.close(fd)


def publish(tmp_path: str, final_path: str, directory: str) -> None:
    """Atomically rename ``tmp_path`` to ``final_path`` and make it durable."""
    fsync_dir(directory)
    os.replace(tmp_path, final_path)
    fsync_dir(directory)


def remove_if_present(paths) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
