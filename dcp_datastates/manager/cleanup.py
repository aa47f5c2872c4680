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
  commit (:func:`retention_victims`): older checkpoints the retention policy
  does not keep. A checkpoint whose ``.metadata`` cannot be read is left
  exactly as it is.
"""

from __future__ import annotations

import fcntl
import os
from typing import Callable, Collection

from dcp_datastates.core.durable import fsync_dir, remove_if_present
from dcp_datastates.core.reader import DataStatesReader
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.file_names import layout_files, stray_files
from dcp_datastates.storage.local import LocalStore
from dcp_datastates.manager.checkpoint_root import (
    LATEST_FILE,
    LATEST_TMP_RE,
    is_committed,
    is_link,
    ResumeOrder,
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
    except (CheckpointError, OSError):
        return []
    return stray_files(os.listdir(path), layout_files(reader.layout))


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


# -- retention ---------------------------------------------------------------------


def retention_keeps(
    committed: list[int], committed_step: int, keep_last: int | None, keep_every: int | None
) -> set[int]:
    """The committed steps (ascending) the policy keeps now that ``committed_step`` committed:
    it, the ``keep_last`` newest up to it, and every multiple of ``keep_every``. The rule of
    both tiers (the local root's retention here, the durable tier's in ``durable_tier``)."""
    upto = [s for s in committed if s <= committed_step]
    keep = {committed_step}
    keep.update(upto if keep_last is None else upto[-keep_last:])
    if keep_every is not None:
        keep.update(s for s in committed if s % keep_every == 0)
    return keep


def spare_referred(victims, present, bases_of: Callable[[int], "set[int] | None"]) -> set[int]:
    """``victims`` (steps) less every step a remaining one of ``present`` refers to, to a fixed
    point, so that whatever stays stays loadable (incremental checkpoints). ``bases_of(step)``:
    the steps it refers to, or None when that cannot be read: then every older victim stays (a
    base is always older than what refers to it). The rule of both tiers."""
    victims = set(victims)
    while victims:
        spared: set[int] = set()
        for s in present:
            if s in victims:
                continue
            bases = bases_of(s)
            spared |= {v for v in victims if v < s} if bases is None else bases & victims
        if not spared:
            break
        victims -= spared
    return victims


def retention_victims(
    root: str,
    committed_step: int,
    keep_last: int | None,
    keep_every: int | None,
    in_flight: Collection[int] = (),
    order: ResumeOrder | None = None,
) -> list[str]:
    """Directory names under ``root`` to delete now that ``committed_step`` is committed.

    Candidates are steps below ``committed_step`` only: committed ones the
    policy does not keep (``keep_last`` counts steps up to
    ``committed_step``, so steps of an abandoned trajectory above it take
    no slot; every multiple of ``keep_every`` is kept) and uncommitted ones
    (failed saves), except steps in ``in_flight`` (saves still writing).
    Symbolic links are never followed into. ``order``: the root's :func:`resume_order`, when
    the caller has it already (one listing of the root for a retention pass).
    """
    dirs = step_dirs(root)
    order = order if order is not None else resume_order(root)
    committed = sorted([*order.candidates, *order.abandoned])
    # Steps below S that a rollback went back past belong to a trajectory given up: they take
    # no slot (and so go), as the abandoned steps above S take none (and stay, to be replaced).
    gone = {s for s in order.abandoned if s < committed_step}
    keep = retention_keeps([s for s in committed if s not in gone], committed_step, keep_last, keep_every)
    return [
        name for s, name in sorted(dirs.items())
        if s < committed_step and s not in keep and s not in in_flight and not is_link(root, name)
    ]
