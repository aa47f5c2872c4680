"""Finding checkpoints and telling their state, in a directory or on a store, without loading them.

What ``ls``, ``du`` and ``verify`` share. States of a checkpoint:

* ``committed``  -- ours, ``.metadata`` present and readable;
* ``dcp``        -- a committed stock DCP (``FileSystemWriter``) checkpoint;
* ``incomplete`` -- no ``.metadata``: a save that never committed;
* ``draining``   -- on a durable tier: confirmations of a drain, no ``.metadata`` yet;
* ``corrupt``    -- ``.metadata`` present but unreadable (damaged, unsafe,
  or from a newer format): run ``verify`` to see why.

A store (``s3://bucket/prefix``) is listed in one request per page, its
objects' sizes asked per object; a directory is scanned.
"""

from __future__ import annotations

import dataclasses
import os
import stat

from dcp_datastates.errors import CheckpointNotFoundError
from dcp_datastates.format.file_names import METADATA_FILE, is_save_file, step_of
from dcp_datastates.storage.url import is_store_url, split_parent
from dcp_datastates.tools.common import one_line

COMMITTED, STOCK_DCP, INCOMPLETE, DRAINING, CORRUPT = "committed", "dcp", "incomplete", "draining", "corrupt"


def dir_files(path: str) -> list[tuple[str, os.stat_result]]:
    """Every regular file under ``path`` (relative name, lstat), not following symbolic links.

    Checkpoints are flat directories, but anything a user dropped in a
    subdirectory still occupies the disk, so it is counted too.
    """
    out = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(path, rel)) as it:
            for entry in it:
                name = os.path.join(rel, entry.name)
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(name)
                elif stat.S_ISREG(st.st_mode):
                    out.append((name, st))
    return sorted(out)


def looks_like_checkpoint(path: str) -> bool:
    """Whether directory ``path`` holds a checkpoint, ours or stock DCP, committed or not
    (by its file names only: ``format/file_names.py``)."""
    try:
        return any(is_save_file(n, stock_dcp=True) for n in os.listdir(path))
    except (NotADirectoryError, FileNotFoundError):
        return False


def require_dir(path: str) -> None:
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path}: not a directory")


def find_checkpoints(path: str) -> list[tuple[int | None, str]]:
    """``(step or None, directory)`` of the checkpoint ``path`` is, or of those directly under it.

    Under a run root that is every ``step_<N>`` directory (committed or not,
    even empty: a step directory is a checkpoint in the making) and every
    other subdirectory holding checkpoint files. Sorted by step, then name.
    """
    require_dir(path)
    if looks_like_checkpoint(path):
        return [(step_of(os.path.basename(os.path.normpath(path))), path)]
    found = []
    for name in os.listdir(path):
        sub = os.path.join(path, name)
        if not os.path.isdir(sub):  # a symlinked checkpoint is listed too (du counts it once)
            continue
        step = step_of(name)
        if step is not None or looks_like_checkpoint(sub):
            found.append((step, sub))
    found.sort(key=lambda sp: (sp[0] is None, sp[0] or 0, os.path.basename(sp[1])))
    return found


def open_checkpoint(path: str, allow_pickle: bool = False):
    """``(state, CheckpointView or None, error message or None)`` of a checkpoint directory or URL.

    Reads ``.metadata`` only (CheckpointView parses it and validates our
    layout); any failure to read it makes the state ``corrupt``, with why.
    """
    from dcp_datastates.tools.checkpoint_view import FORMAT_OURS, CheckpointView

    if not is_store_url(path) and not os.path.lexists(os.path.join(path, METADATA_FILE)):
        return INCOMPLETE, None, f"{path} has no {METADATA_FILE}: the save never committed"
    try:
        view = CheckpointView(path, allow_pickle=allow_pickle)
    except Exception as exc:  # noqa: BLE001 - whatever makes it unreadable is reported, not raised
        return CORRUPT, None, one_line(exc)
    return (COMMITTED if view.format == FORMAT_OURS else STOCK_DCP), view, None


def rank_count(view) -> int:
    """Rank files the metadata names (ours: one data file per rank; stock DCP: its ``.distcp`` files)."""
    return len(view.files()) - 1 if view.format == STOCK_DCP else len(view.reader.layout.own_ranks)


@dataclasses.dataclass
class StoredStep:
    """A step directory in a store: its state and objects (name under the step -> bytes)."""

    step: int
    name: str
    state: str  # committed, draining or incomplete (by the names present)
    sizes: dict[str, int]


def split_step_url(url: str) -> tuple[str, str | None]:
    """``(root URL, step directory or None)``: ``s3://b/run/step_00000010`` -> ``(s3://b/run, step_00000010)``."""
    root, name = split_parent(url)
    if step_of(name) is not None:
        return root, name
    return url.rstrip("/"), None


def stored_steps(store) -> list[StoredStep]:
    """Every step under the store's root, with its state and objects (one listing, plus sizes)."""
    from dcp_datastates.tiers.drain import CONFIRM_DIR, keys_by_step

    out = []
    for step, (name, rests) in sorted(keys_by_step(store).items()):
        if METADATA_FILE in rests:
            state = COMMITTED
        elif any(r.startswith(CONFIRM_DIR + "/") for r in rests):
            state = DRAINING
        else:
            state = INCOMPLETE
        out.append(StoredStep(step, name, state, {r: store.size(f"{name}/{r}") or 0 for r in rests}))
    return out
