"""The commit of a save: a checkpoint exists once its ``.metadata`` is in place.

Everything ``.metadata`` refers to must be on disk before that name exists,
so the order is: data and index files fsynced (by each rank), the metadata
written under a temporary name and fsynced, the directory fsynced (their
names are durable), the temporary renamed to ``.metadata`` without replacing
one another save committed meanwhile, and the directory fsynced again (the
rename is durable). An error after the rename never removes the committed
checkpoint's files. The file operations are those of :mod:`storage.fsync_files`.
"""

from __future__ import annotations

import os

from dcp_datastates.storage.fsync_files import fsync_dir, remove_if_present, rename_into_place, rename_without_replacing, write_new_file_durably
from dcp_datastates.errors import CheckpointError, CheckpointExistsError
from dcp_datastates.format.checkpoint_layout import CheckpointLayout
from dcp_datastates.format.file_names import METADATA_FILE, layout_files, metadata_tmp_name
from dcp_datastates.format.metadata_file import read_metadata_file


# -- committing a save ---------------------------------------------------------------


def refuse_committed(path: str) -> None:
    """Raise :class:`CheckpointExistsError` if ``path`` holds a committed checkpoint."""
    if os.path.exists(os.path.join(path, METADATA_FILE)):
        raise CheckpointExistsError(
            f"{path} already holds a committed checkpoint (.metadata exists), and DataStatesWriter does "
            "not save over one unless asked. DCP's FileSystemWriter replaces it by default (its "
            f"overwrite=True); to do the same, pass DataStatesWriter({path!r}, overwrite=True): the old "
            "checkpoint stays loadable until the new one commits, and its files are removed then"
        )


def write_metadata_tmp(path: str, save_id: str, blob: bytes) -> str:
    """Write a save's encoded ``.metadata`` durably under its temporary name; returns that path."""
    tmp = os.path.join(path, metadata_tmp_name(save_id))
    write_new_file_durably(tmp, blob)
    return tmp


def commit_metadata(path: str, tmp: str, overwrite: bool) -> None:
    """Rename a save's temporary metadata to ``.metadata``: the commit.

    Without ``overwrite`` the rename never replaces a ``.metadata`` that
    appeared since the save began (another save into the same directory,
    in this process or another, committed first): exactly one of two racing
    saves commits, and the other fails with :class:`CheckpointExistsError`
    (its caller removes its files).
    """
    final = os.path.join(path, METADATA_FILE)
    if overwrite:
        rename_into_place(tmp, final, path)
        return
    try:
        rename_without_replacing(tmp, final, path)
    except FileExistsError:
        raise CheckpointExistsError(
            f"{path}: another save committed a checkpoint there while this one was writing; "
            "this save was not committed and its files were removed (pass "
            "DataStatesWriter(..., overwrite=True) to replace a committed checkpoint instead)"
        ) from None


def renamed_into_place(path: str, tmp: str | None) -> bool:
    """Whether a save's temporary metadata ``tmp`` has already become ``.metadata`` (committed).

    The link-then-unlink commit (filesystems without RENAME_NOREPLACE) may be
    interrupted between its two steps: both names then exist and are one file.
    """
    if tmp is None:
        return False
    final = os.path.join(path, METADATA_FILE)
    try:
        if os.path.exists(tmp):
            return os.path.samefile(tmp, final)
    except FileNotFoundError:
        return False
    return os.path.exists(final)


def files_of_committed(path: str) -> list[str]:
    """Our rank files named by the committed checkpoint in ``path`` (to remove once replaced).

    Read in safe mode (never runs code); a checkpoint that is not ours, or
    unreadable or damaged, names nothing: nothing is removed.
    """
    md_path = os.path.join(path, METADATA_FILE)
    try:
        metadata, _ = read_metadata_file(md_path)
        layout = getattr(metadata, "storage_data", None)
        if not isinstance(layout, CheckpointLayout):
            return []
        layout.validate(md_path)  # only our own rank-file names, never a path out of the directory
    except Exception:  # noqa: BLE001 - not ours, unreadable or damaged: remove nothing
        return []
    return layout_files(layout)


def make_durable_after_commit(path: str, stale: list[str]) -> None:
    """After the rename: fsync the directory (the commit is durable), then remove ``stale`` files
    (those of a checkpoint this one replaced) and fsync again.

    The checkpoint is committed already, so a failure here must not remove
    anything of it: it is reported as what it is.
    """
    try:
        fsync_dir(path)
        if stale:
            remove_if_present(stale)
            fsync_dir(path)
    except OSError as exc:
        raise CheckpointError(
            f"{path} is committed (.metadata is in place), but making that durable failed: "
            f"{exc}; it may not survive a power loss, and files of the checkpoint it replaced may remain"
        ) from exc
