"""Where a save writes: a checkpoint's place in a store (a directory, or a prefix in object storage).

A save does the same things wherever it writes, in the same order
(docs/architecture.md): refuse a committed checkpoint unless overwriting,
stream each rank's data files through the engine, write each rank's index,
stage the metadata while the data is written, commit it last, and remove
everything on failure. :class:`Destination` is that sequence over any
:class:`storage.Store`; how each step touches storage is the store's:

* a directory (:class:`storage.local.LocalStore`): engine jobs ``pwrite``
  (O_DIRECT where allowed) and fsync the files; the metadata is written
  durably under its temporary name and renamed to ``.metadata`` without
  replacing one, the directory fsynced;
* object storage (:class:`storage.s3.S3Store`): engine jobs stream their
  windows into multipart uploads in bounded memory, each object read back
  and compared; the metadata stays in memory until the commit, a single PUT
  that succeeds only if no ``.metadata`` is there (``If-None-Match``).

Either way the checkpoint appears whole, last, exactly once.
"""

from __future__ import annotations

import errno
import os
import posixpath

from dcp_datastates.errors import CheckpointError, CheckpointExistsError
from dcp_datastates.format.checkpoint_layout import CheckpointLayout
from dcp_datastates.format.file_names import METADATA_FILE, layout_files, metadata_tmp_name
from dcp_datastates.format.metadata_file import read_metadata_file
from dcp_datastates.storage import ObjectExistsError, Store, StoreError, is_committed, open_store
from dcp_datastates.storage.local import LocalStore
from dcp_datastates.storage.url import is_store_url, split_parent


def destination_of(location: str, store_options: dict | None = None, verify_upload: bool = True) -> Destination:
    """The destination a save into ``location`` (a directory path or an ``s3://`` URL) writes to:
    a URL's parent opened as the store and the checkpoint its prefix there; a directory as a
    store of its own (its files at its root)."""
    if is_store_url(location):
        parent, name = split_parent(location)
        if not name:
            raise ValueError(f"{location!r}: a checkpoint needs a prefix of its own in the bucket (s3://bucket/run/step_...)")
        return Destination(open_store(parent, **(store_options or {})), name, location, verify_upload)
    return Destination(LocalStore(os.fspath(location)), "", os.fspath(location), verify_upload)


def _place(location: str) -> str:
    return location.rstrip("/") if is_store_url(location) else os.path.abspath(location)


class Destination:
    """A checkpoint under the key prefix ``prefix`` of ``store`` (``""``: the store's root), named
    ``location`` as the user gave it (see the module docstring)."""

    def __init__(self, store: Store, prefix: str, location: str, verify_upload: bool = True) -> None:
        self.store, self.prefix, self.location = store, prefix, location
        self.verify_upload = verify_upload  # an upload read back and compared (a file is fsynced instead)

    @property
    def is_file_system(self) -> bool:
        return self.store.is_file_system

    def key(self, name: str) -> str:
        return posixpath.join(self.prefix, name) if self.prefix else name

    def where(self, name: str) -> str:
        return self.store.where(self.key(name))

    def same_place(self, other: str) -> bool:
        return _place(os.fspath(other)) == _place(self.location)

    def prepare(self) -> None:
        self.store.make_prefix(self.prefix)

    def refuse_committed(self) -> None:
        """Raise :class:`CheckpointExistsError` if a committed checkpoint is there."""
        if is_committed(self.store, self.prefix):
            raise CheckpointExistsError(
                f"{self.location} already holds a committed checkpoint (.metadata exists), and DataStatesWriter "
                "does not save over one unless asked. DCP's FileSystemWriter replaces it by default (its "
                f"overwrite=True); to do the same, pass DataStatesWriter({self.location!r}, overwrite=True): the "
                "old checkpoint stays loadable until the new one commits, and its files are removed then"
            )

    def check_free_space(self, nbytes: int) -> None:
        """Refuse a striped rank that cannot fit, before any byte moves. Each job checks (or
        reserves) its own stripe only, so stripes that each fit could together overflow."""
        free = self.store.free_space(self.prefix)
        if free is not None and free < nbytes:
            raise OSError(errno.ENOSPC, f"reserving space: the rank's stripes need {nbytes} bytes, {free} are free",
                          self.location)

    def start_write(self, engine, name: str, regions, keep, **options):
        """The engine job writing the file ``name`` (``options``: the engine's; a store takes
        those that apply to it: a streamed window always goes through the pool, which is what
        bounds an upload's memory, and the bytes a file would reserve size an upload's parts)."""
        return self.store.start_write(engine, self.key(name), regions, keep, verify=self.verify_upload, **options)

    def write_index(self, name: str, blob: bytes) -> None:
        self.store.put_in_place(self.key(name), blob)  # its name is this save's own

    def stage_metadata(self, save_id: str, blob: bytes):
        """The encoded ``.metadata``, staged for the commit (durable under its temporary name, or
        held in memory: nothing is visible before the commit)."""
        return self.store.stage_bytes(self.key(METADATA_FILE), blob, staging_key=self.key(metadata_tmp_name(save_id)))

    def discard_metadata(self, staged) -> None:
        if staged is not None:
            staged.abandon()

    def committed_by(self, staged) -> bool | None:
        """Whether the staged ``.metadata`` is in place (a commit interrupted right after its
        rename, or whose PUT landed though its answer was lost); None when the store cannot
        tell, which a cleanup takes for yes: the files stay (strays at worst), never deleted
        under a ``.metadata`` that names them."""
        return False if staged is None else staged.landed()

    def files_of_committed(self) -> list[str]:
        """Our rank files the committed checkpoint names (to remove once replaced), read in safe
        mode (never runs code); nothing for a checkpoint that is not ours, unreadable or damaged."""
        try:
            with self.store.open_file(self.key(METADATA_FILE)) as f:
                metadata, _ = read_metadata_file(f)
            layout = metadata.storage_data
            if not isinstance(layout, CheckpointLayout):
                return []
            layout.validate(self.where(METADATA_FILE))  # only our own rank-file names, never a path out
        except Exception:  # noqa: BLE001 - not ours, unreadable or damaged: remove nothing
            return []
        return layout_files(layout)

    def commit_metadata(self, staged, overwrite: bool) -> None:
        """Publish the staged ``.metadata``: the commit. Without ``overwrite`` it never replaces
        a ``.metadata`` that appeared since the save began (another save, in this process or
        another, committed first): exactly one of two racing saves commits, and the other fails
        with :class:`CheckpointExistsError` (its caller removes its files). An error once the
        ``.metadata`` is in place says so: nothing of the committed checkpoint is removed."""
        try:
            staged.publish(replace=overwrite)
        except ObjectExistsError:
            raise CheckpointExistsError(
                f"{self.location}: another save committed a checkpoint there while this one was writing; "
                "this save was not committed and its files were removed (pass "
                "DataStatesWriter(..., overwrite=True) to replace a committed checkpoint instead)"
            ) from None
        except StoreError as exc:
            if staged.landed():
                raise CheckpointError(
                    f"{self.location} is committed (.metadata is in place), but making that durable failed: "
                    f"{exc}; it may not survive a power loss, and files of the checkpoint it replaced may remain"
                ) from exc
            raise

    def after_commit(self, stale: list[str]) -> None:
        """Remove the files of the checkpoint this one replaced (``stale``)."""
        if not stale:
            return
        try:
            self.store.delete([self.key(f) for f in stale])
        except StoreError as exc:
            raise CheckpointError(
                f"{self.location} is committed (.metadata is in place), but removing the files of the "
                f"checkpoint it replaced failed: {exc}; they remain (verify lists them as strays)"
            ) from exc

    def remove(self, names: list[str]) -> None:
        """Remove a failed save's files; a store that does not answer leaves them (strays that
        verify lists and the next save's cleanup ignores), never hiding the save's own error."""
        try:
            self.store.delete([self.key(n) for n in names])
        except StoreError:
            pass
