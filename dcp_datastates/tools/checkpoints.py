"""Finding checkpoints and telling their state, in a directory or on a store, without loading them.

What ``ls``, ``du`` and ``verify`` share. States of a checkpoint:

* ``committed``  -- ours, ``.metadata`` present and readable;
* ``dcp``        -- a committed stock DCP (``FileSystemWriter``) checkpoint;
* ``incomplete`` -- no ``.metadata``: a save that never committed;
* ``draining``   -- on a durable tier: confirmations of a drain, no ``.metadata`` yet;
* ``corrupt``    -- ``.metadata`` present but unreadable (damaged, unsafe,
  or from a newer format): run ``verify`` to see why.

A store (``s3://bucket/prefix``) is listed in one request per page, its
objects' sizes asked per object; a directory is scanned. What a run root
stands for (its committed steps, or the one ``latest`` names) is
:func:`checkpoints_named`, for ``verify`` and ``inspect`` alike; what a
listing shows of a checkpoint is :func:`summarize_checkpoint`, read without
torch where the metadata has a plain record.
"""

from __future__ import annotations

import dataclasses
import os
import stat

from dcp_datastates.errors import CheckpointError, CheckpointNotFoundError
from dcp_datastates.format.file_names import METADATA_FILE, is_save_file, listed_step_of, step_of
from dcp_datastates.storage.local import is_committed_directory
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
    other subdirectory holding checkpoint files, except a tool's partial
    output (:func:`partial_outputs`). Sorted by step, then name.
    """
    from dcp_datastates.tools.output import partial_output_of

    require_dir(path)
    if looks_like_checkpoint(path):
        return [(listed_step_of(os.path.basename(os.path.normpath(path))), path)]
    found = []
    for name in os.listdir(path):
        sub = os.path.join(path, name)
        # a symlinked checkpoint is listed too (du counts it once); a tool's partial output is not one
        if not os.path.isdir(sub) or partial_output_of(name) is not None:
            continue
        step = listed_step_of(name)
        if step is not None or looks_like_checkpoint(sub):
            found.append((step, sub))
    found.sort(key=lambda sp: (sp[0] is None, sp[0] or 0, os.path.basename(sp[1])))
    return found


def partial_outputs(path: str) -> list[str]:
    """The partial outputs of ``convert`` and ``export`` directly under the directory ``path``
    (hidden temporaries, :func:`output.partial_output_of`): being written now, or left by a tool
    that was killed before it could remove them. Sorted by name; none in a checkpoint."""
    from dcp_datastates.tools.output import partial_output_of

    if looks_like_checkpoint(path):
        return []
    return sorted(os.path.join(path, n) for n in os.listdir(path) if partial_output_of(n) is not None)


def open_checkpoint(path: str, allow_pickle: bool = False):
    """``(state, CheckpointView or None, error message or None)`` of a checkpoint directory or URL.

    Reads ``.metadata`` only (CheckpointView parses it and validates our
    layout); any failure to read it makes the state ``corrupt``, with why.
    """
    from dcp_datastates.tools.checkpoint_view import FORMAT_OURS, CheckpointView

    if not is_store_url(path):
        try:
            if not is_committed_directory(path):
                return INCOMPLETE, None, f"{path} has no {METADATA_FILE}: the save never committed"
        except CheckpointError as exc:  # a .metadata that is not a regular file
            return CORRUPT, None, one_line(exc)
    try:
        view = CheckpointView(path, allow_pickle=allow_pickle)
    except Exception as exc:  # noqa: BLE001 - whatever makes it unreadable is reported, not raised
        return CORRUPT, None, one_line(exc)
    return (COMMITTED if view.format == FORMAT_OURS else STOCK_DCP), view, None


@dataclasses.dataclass(frozen=True)
class CheckpointSummary:
    """What ``ls`` and ``du`` show of a committed checkpoint: its keys, its ranks and the files
    its metadata names (relative to it, ``.metadata`` first)."""

    keys: int
    ranks: int
    files: list[str]


def summarize_checkpoint(path: str):
    """``(state, CheckpointSummary or None, error message or None)``: :func:`open_checkpoint`'s
    answer, reduced to what a listing shows.

    A local checkpoint of ours (format 6 on) is summarized from its metadata's
    plain record, checksum verified and layout validated, without importing
    torch; ``verify`` and a load check every item. Anything else (stock DCP,
    older formats, a URL) is opened by :func:`open_checkpoint`.
    """
    from dcp_datastates.format.file_names import layout_files
    from dcp_datastates.format.metadata_envelope import read_record
    from dcp_datastates.format.metadata_record import summarize_record

    if not is_store_url(path):
        where = os.path.join(path, METADATA_FILE)
        if not os.path.lexists(where):
            return INCOMPLETE, None, f"{path} has no {METADATA_FILE}: the save never committed"
        try:
            record = read_record(where)
            if record is not None:
                summary = summarize_record(record, where)
                files = [METADATA_FILE] + layout_files(summary.layout)
                return COMMITTED, CheckpointSummary(summary.keys, len(summary.layout.own_ranks), files), None
        except Exception as exc:  # noqa: BLE001 - as open_checkpoint: unreadable is a state, with why
            return CORRUPT, None, one_line(exc)
    state, view, error = open_checkpoint(path)
    if view is None:
        return state, None, error
    return state, CheckpointSummary(len(view.metadata.state_dict_metadata), rank_count(view), view.files()), None


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


def checkpoints_named(location: str, latest: bool = False) -> list[str]:
    """The checkpoints ``location`` stands for, in step order.

    A checkpoint (a directory holding checkpoint files, a step's URL
    ``s3://bucket/run/step_N``) stands for itself, and so does anything else
    that is no run root (a missing path, an empty directory: the command says
    what it is). A run root (a directory of checkpoint directories, e.g. a
    CheckpointManager root, or a tier's root URL
    ``s3://bucket/run``) stands for every committed checkpoint under it, or,
    with ``latest``, for the one its ``latest`` pointer names. ``latest`` on a
    checkpoint, a root without a pointer, or a pointer naming a step that is
    missing or not committed, raises an error naming the root.
    """
    if is_store_url(location):
        return _stored_checkpoints(location, latest)
    is_root = os.path.isdir(location) and not looks_like_checkpoint(location)
    found = find_checkpoints(location) if is_root else []
    if not found:
        if latest:
            raise ValueError(f"{location} is not a run root (a directory of step directories), which --latest takes")
        return [location]
    if not latest:
        return [path for _, path in found if _committed_or_refused(path)]
    from dcp_datastates.manager.checkpoint_root import LATEST_FILE, read_pointer, step_dirs

    pointer = read_pointer(location)
    where = os.path.join(location, LATEST_FILE)
    if pointer is None:
        raise CheckpointNotFoundError(
            f"{where}: no such pointer: {location} is not a CheckpointManager root, or has no committed step yet"
        )
    name = step_dirs(location).get(pointer.step)
    if name is None:
        raise CheckpointNotFoundError(f"{where} names step {pointer.step}, which has no directory in {location}")
    path = os.path.join(location, name)
    if not _committed_or_refused(path):
        raise CheckpointNotFoundError(f"{where} names step {pointer.step}, whose checkpoint {path} is not committed")
    return [path]


def _committed_or_refused(path: str) -> bool:
    """Whether the directory holds a ``.metadata``: committed, or one the store refuses (a link),
    which its check then reports as corrupt rather than passing over it."""
    try:
        return is_committed_directory(path)
    except CheckpointError:
        return True


def _stored_checkpoints(url: str, latest: bool) -> list[str]:
    """:func:`checkpoints_named` of a URL: a step's URL, or a tier's root (its pointer mirrored there)."""
    from dcp_datastates.storage import open_store

    root, step_dir = split_step_url(url)
    if step_dir is not None:
        if latest:
            raise ValueError(f"{url} is a checkpoint, not a run root: --latest takes a tier's root URL")
        return [url]
    store = open_store(root)
    try:
        steps = [s for s in stored_steps(store) if s.state == COMMITTED]
        if not latest:
            return [f"{root}/{s.name}" for s in steps]
        from dcp_datastates.manager.checkpoint_root import LATEST_FILE
        from dcp_datastates.manager.durable_tier import read_tier_pointer

        pointer = read_tier_pointer(store)
        where = store.where(LATEST_FILE)
    finally:
        store.close()
    if pointer is None:
        raise CheckpointNotFoundError(
            f"{where}: no such pointer: {root} is not a durable tier of a CheckpointManager run"
        )
    named = [s for s in steps if s.step == pointer.step]
    if not named:
        raise CheckpointNotFoundError(f"{where} names step {pointer.step}, which has no committed copy under {root}")
    return [f"{root}/{named[0].name}"]
