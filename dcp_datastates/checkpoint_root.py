"""The on-disk layout of a run's checkpoint root (what ``CheckpointManager`` keeps).

::

    ROOT/
        step_00000100/     a checkpoint (committed when it holds .metadata)
        step_00000200/
        latest             {"step": 200, "dir": "step_00000200"}: the newest checkpoint
                           known committed and durable, replaced atomically

Step directories are named ``step_`` and the step number, zero-padded to 8
digits (longer numbers simply get more digits); tools order them by number.
``latest`` is JSON so shell scripts and other tools can read it; it is only
ever replaced by renaming a fully written, fsynced temporary over it, so a
reader sees the old pointer or the new one, never a torn one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from .commit import fsync_dir, rename_into_place, remove_if_present, write_new_file_durably
from .format import METADATA_FILE

STEP_DIR_RE = re.compile(r"^step_(\d+)$")
LATEST_FILE = "latest"
LATEST_TMP_RE = re.compile(r"^latest\.[0-9a-f]+\.tmp$")
_POINTER_LIMIT = 4096  # a pointer file is a few dozen bytes; anything bigger is not one


def step_dir_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a checkpoint step must be a non-negative int, got {step!r}")
    return f"step_{step:08d}"


def step_dirs(root: str) -> dict[int, str]:
    """``{step: directory name}`` of every step directory under ``root`` (committed or not).

    Two names for one step (``step_7`` and ``step_00000007``) are an error,
    because tools could not tell which one is meant.
    """
    out: dict[int, str] = {}
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for name in names:
        m = STEP_DIR_RE.match(name)
        if m is None or not os.path.isdir(os.path.join(root, name)):
            continue
        step = int(m.group(1))
        if step in out:
            raise ValueError(f"{root}: two directories for step {step}: {out[step]} and {name}")
        out[step] = name
    return out


def is_link(root: str, name: str) -> bool:
    """Whether ``root/name`` is a symbolic link (a step directory linked from elsewhere:
    readable like any other, but never cleaned up or deleted through the link)."""
    return os.path.islink(os.path.join(root, name))


def is_committed(path: str) -> bool:
    """Whether the checkpoint directory ``path`` has been committed (its ``.metadata`` exists)."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def read_latest(root: str) -> int | None:
    """The step the ``latest`` pointer names, or None when there is no pointer.

    A pointer that is not what :func:`write_latest` writes raises ValueError
    naming the file (it is never silently ignored).
    """
    path = os.path.join(root, LATEST_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        blob = os.read(fd, _POINTER_LIMIT + 1)
    finally:
        os.close(fd)
    try:
        record = json.loads(blob.decode("utf-8")) if len(blob) <= _POINTER_LIMIT else None
        step = record["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0 or record["dir"] != step_dir_name(step):
            raise ValueError
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise ValueError(f"{path} is not a checkpoint pointer (expected {{\"step\": N, \"dir\": \"step_...\"}})") from None
    return step


@dataclasses.dataclass
class ResumeOrder:
    """Which committed checkpoints a resume tries, in order, and which it must not.

    ``candidates``: checkpoints committed after the pointer last moved (a crash
    fell between their commit and the pointer update; newest commit first),
    then the step the pointer names, then the steps below it, newest first.
    ``abandoned``: steps above the pointer's that were committed before it
    moved: a run resumed from an older step and went on from there (a
    rollback, or a newer checkpoint skipped as corrupt), so they belong to a
    trajectory that was given up. They are not resumed from, a new save may
    replace them, and retention leaves them alone.
    """

    candidates: list[int]
    abandoned: list[int]
    pointer: int | None
    pointer_error: str | None = None


def resume_order(root: str) -> ResumeOrder:
    """Order the committed checkpoints of ``root`` for a resume (see :class:`ResumeOrder`).

    Commit times are the ``st_ctime`` of each ``.metadata`` (set by the rename
    that committed it) and of ``latest`` (set by the rename that moved it).
    """
    dirs = step_dirs(root)
    times: dict[int, int] = {}  # step -> when its .metadata appeared; a directory deleted meanwhile drops out
    for step, name in dirs.items():
        try:
            times[step] = os.stat(os.path.join(root, name, METADATA_FILE)).st_ctime_ns
        except (FileNotFoundError, NotADirectoryError):
            pass
    committed = sorted(times)
    try:
        pointer = read_latest(root)
        error = None
        moved = os.stat(os.path.join(root, LATEST_FILE)).st_ctime_ns if pointer is not None else 0
    except ValueError as exc:
        pointer, error = None, str(exc)
    except FileNotFoundError:  # replaced between the read and the stat: treat as no pointer
        pointer, error = None, None
    if pointer is None or pointer not in committed:
        return ResumeOrder(committed[::-1], [], pointer, error)
    committed_at = times.__getitem__

    newer = sorted((s for s in committed if s != pointer and committed_at(s) > moved), key=committed_at, reverse=True)
    abandoned = [s for s in committed if s > pointer and s not in newer]
    below = [s for s in committed[::-1] if s < pointer and s not in newer]
    return ResumeOrder(newer + [pointer] + below, abandoned, pointer, error)


def write_latest(root: str, step: int) -> None:
    """Point ``latest`` at ``step``: write a temporary, fsync it, rename it over, fsync ``root``."""
    record = json.dumps({"step": step, "dir": step_dir_name(step)}) + "\n"
    tmp = os.path.join(root, f"{LATEST_FILE}.{os.getpid():x}.tmp")
    remove_if_present([tmp])
    write_new_file_durably(tmp, record.encode())
    try:
        rename_into_place(tmp, os.path.join(root, LATEST_FILE), root)
    except BaseException:
        remove_if_present([tmp])
        raise
    fsync_dir(root)


def durable_dir(path: str) -> None:
    """fsync a checkpoint directory and its parent, so its commit survives a power loss."""
    fsync_dir(path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
