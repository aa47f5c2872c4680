"""Deleting in a run's checkpoint root: crash leftovers, retention, and who may do either.

Everything that removes files from a root is here, under three rules:

* **One owner.** Only the holder of the exclusive ``flock`` on
  ``ROOT/.manager.lock`` deletes anything (:func:`lock_root`). A second
  manager on the same root (an evaluation job, a notebook) would otherwise
  take the owner's in-flight save for a crash leftover and remove it.
* **Never a committed checkpoint with files missing.** A checkpoint
  directory is deleted ``.metadata`` first, with the directory fsynced
  before the rest goes (:func:`delete_checkpoint_dir`): a crash part-way
  leaves an uncommitted leftover, which readers refuse and the next start
  removes. Nothing is deleted through a symbolic link.
* **Only what no checkpoint needs.** At start (:func:`recover_root`): step
  directories never committed, strays inside committed checkpoints (rank
  files of a killed overwrite, ``.metadata`` temporaries: the rule is
  :mod:`dcp_datastates.format.file_names`), pointer temporaries. After a
  commit: the older checkpoints :mod:`retention` gives up. A checkpoint whose
  ``.metadata`` cannot be read is left exactly as it is.
"""

from __future__ import annotations

import fcntl
import os
from typing import Callable

from dcp_datastates.storage.fsync_files import fsync_dir, remove_if_present
from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.file_names import layout_files, stray_files
from dcp_datastates.storage.local import LocalStore
from dcp_datastates.manager.checkpoint_root import (
    LATEST_FILE,
    LATEST_TMP_RE,
    is_committed,
    is_link,
    point_latest_at,
    resume_order,
    step_dirs,
)

LOCK_FILE = ".manager.lock"


# -- owning the root ---------------------------------------------------------------


def lock_root(root: str) -> int | None:
    """Take the exclusive lock on ``root/.manager.lock``: its open descriptor (the lock lasts
    until :func:`unlock_root` or the process ends), or None when another process holds it."""
    fd = os.open(os.path.join(root, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def unlock_root(fd: int) -> None:
    os.close(fd)  # drops the flock


# -- deleting safely ---------------------------------------------------------------


def delete_checkpoint_dir(path: str) -> None:
    """Delete a checkpoint directory so that no crash can leave it committed but partial
    (``Store.delete_checkpoint``: ``.metadata`` first; never through a symbolic link)."""
    parent, name = os.path.split(os.path.abspath(path))
    LocalStore(parent).delete_checkpoint(name)


def committed_strays(path: str, allow_pickle: bool = False) -> list[str]:
    """Files in the committed checkpoint ``path`` that it does not name (safe to delete).

    Rank files of an earlier save into the same directory that was killed,
    and ``.metadata`` temporaries. Returns [] when the metadata cannot be read
    (a damaged checkpoint is left exactly as it is).
    """
    try:
        reader = DataStatesReader(path, allow_pickle=allow_pickle)
        reader.load_metadata()
        layout = reader.require_layout()
    except (CheckpointError, OSError):
        return []
    return stray_files(os.listdir(path), layout_files(layout))


# -- after a crash -----------------------------------------------------------------


def recover_root(root: str, allow_pickle: bool, warn: Callable[[str], None]) -> None:
    """Remove what crashed saves left in ``root`` and repair a stale pointer (the owner, at start).

    Step directories never committed are deleted (each announced through
    ``warn``), strays inside committed ones removed, and ``latest`` moved to
    the newest commit when a crash fell between that commit and its pointer
    update (removed when no checkpoint is left for it to name).
    """
    for name in os.listdir(root):
        if LATEST_TMP_RE.match(name):
            remove_if_present([os.path.join(root, name)])
    for _step, name in sorted(step_dirs(root).items()):
        path = os.path.join(root, name)
        if is_link(root, name):
            continue  # linked from elsewhere: not ours to clean
        if not is_committed(path):
            warn(f"removing {path}: a checkpoint that was never committed (left by an interrupted save)")
            delete_checkpoint_dir(path)
            continue
        remove_if_present([os.path.join(path, stray) for stray in committed_strays(path, allow_pickle)])
    order = resume_order(root)
    if order.pointer_error:
        warn(f"{order.pointer_error}; rewriting it")
    if order.candidates and order.pointer != order.candidates[0]:
        point_latest_at(root, order.candidates[0], rollbacks=order.rollbacks)  # the run's record kept
    elif not order.candidates and (order.pointer is not None or order.pointer_error):
        remove_if_present([os.path.join(root, LATEST_FILE)])
        fsync_dir(root)
