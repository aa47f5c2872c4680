"""Where a save writes: a checkpoint directory, or a checkpoint's prefix in object storage.

A save does the same things on both, in the same order (docs/architecture.md):
refuse a committed checkpoint unless overwriting, stream each rank's data
files through the engine, write each rank's index, stage the metadata while
the data is written, commit it last, and remove everything on failure. What
differs is how each step touches storage, and that is all this module holds:

* :class:`DirectoryDestination`: engine jobs ``pwrite`` (O_DIRECT where
  allowed) and fsync the files; the metadata is written durably under a
  temporary name and renamed to ``.metadata`` without replacing one
  (:mod:`commit`), then the directory is fsynced.
* :class:`StoreDestination`: engine jobs stream their windows into objects
  (:class:`storage.upload.StreamUpload`: multipart uploads in bounded memory,
  each object read back and compared); the metadata stays in memory until
  the commit, a single PUT that succeeds only if no ``.metadata`` is there
  (``If-None-Match``), so the object appears whole, last, exactly once.
"""

from __future__ import annotations

import os
import posixpath

from dcp_datastates.core import commit
from dcp_datastates.storage import fsync_files
from dcp_datastates.errors import CheckpointError, CheckpointExistsError
from dcp_datastates.format.checkpoint_layout import CheckpointLayout
from dcp_datastates.format.file_names import METADATA_FILE, layout_files
from dcp_datastates.format.metadata_file import read_metadata_file
from dcp_datastates.storage import ObjectExistsError, Store, StoreError, is_committed, open_store
from dcp_datastates.storage.url import is_store_url, split_parent


def destination_of(location: str, store_options: dict | None = None, verify_upload: bool = True):
    """The destination a save into ``location`` (a directory path or an ``s3://`` URL) writes to."""
    if is_store_url(location):
        parent, name = split_parent(location)
        if not name:
            raise ValueError(f"{location!r}: a checkpoint needs a prefix of its own in the bucket (s3://bucket/run/step_...)")
        return StoreDestination(open_store(parent, **(store_options or {})), name, location, verify_upload)
    return DirectoryDestination(location)


class DirectoryDestination:
    """A checkpoint directory (see the module docstring)."""

    is_local = True

    def __init__(self, path: str) -> None:
        self.location = path

    def where(self, name: str) -> str:
        return os.path.join(self.location, name)

    def same_place(self, other: str) -> bool:
        return not is_store_url(other) and os.path.abspath(other) == os.path.abspath(self.location)

    def prepare(self) -> None:
        os.makedirs(self.location, exist_ok=True)

    def refuse_committed(self) -> None:
        commit.refuse_committed(self.location)

    def check_free_space(self, nbytes: int) -> None:
        """Refuse a striped rank that cannot fit, before any byte moves. Each job checks (or
        reserves) its own stripe only, so stripes that each fit could together overflow."""
        st = os.statvfs(self.location)
        free = st.f_bavail * st.f_frsize
        if free < nbytes:
            import errno

            raise OSError(errno.ENOSPC, f"reserving space: the rank's stripes need {nbytes} bytes, {free} are free",
                          self.location)

    def start_write(self, engine, name: str, regions, keep, **options):
        return engine.write(self.where(name), regions, keep, **options)

    def write_index(self, name: str, blob: bytes) -> None:
        fsync_files.write_new_file_durably(self.where(name), blob)

    def stage_metadata(self, save_id: str, blob: bytes):
        return commit.write_metadata_tmp(self.location, save_id, blob)

    def discard_metadata(self, staged) -> None:
        if staged is not None:
            fsync_files.remove_if_present([staged])

    def committed_by(self, staged) -> bool:
        return commit.renamed_into_place(self.location, staged)

    def files_of_committed(self) -> list[str]:
        return commit.files_of_committed(self.location)

    def commit_metadata(self, staged, overwrite: bool) -> None:
        commit.commit_metadata(self.location, staged, overwrite)

    def after_commit(self, stale: list[str]) -> None:
        commit.make_durable_after_commit(self.location, [self.where(f) for f in stale])

    def remove(self, names: list[str]) -> None:
        fsync_files.remove_if_present([self.where(n) for n in names])


class StoreDestination:
    """A checkpoint's prefix ``prefix`` in ``store`` (see the module docstring)."""

    is_local = False

    def __init__(self, store: Store, prefix: str, location: str, verify_upload: bool = True) -> None:
        self.store, self.prefix, self.location = store, prefix, location
        self.verify_upload = verify_upload

    def key(self, name: str) -> str:
        return posixpath.join(self.prefix, name)

    def where(self, name: str) -> str:
        return self.store.where(self.key(name))

    def same_place(self, other: str) -> bool:
        return is_store_url(other) and other.rstrip("/") == self.location.rstrip("/")

    def prepare(self) -> None:
        pass  # an object store has no directories

    def refuse_committed(self) -> None:
        if is_committed(self.store, self.prefix):
            raise CheckpointExistsError(
                f"{self.location} already holds a committed checkpoint (.metadata exists), and "
                "DataStatesWriter does not save over one unless asked; pass "
                f"DataStatesWriter({self.location!r}, overwrite=True) to replace it (the old checkpoint "
                "stays loadable until the new one commits, and its objects are removed then)"
            )

    def check_free_space(self, nbytes: int) -> None:
        pass

    def start_write(self, engine, name: str, regions, keep, preallocate: int = 0, **_options):
        # direct_io and borrow are a file's: a streamed window always goes through the pool, which
        # is what bounds the memory of the upload. The bytes a file would reserve size its parts.
        return self.store.start_write(engine, self.key(name), regions, keep, verify=self.verify_upload,
                                      preallocate=preallocate)

    def write_index(self, name: str, blob: bytes) -> None:
        self.store.put_bytes(self.key(name), blob)  # its name is this save's own

    def stage_metadata(self, save_id: str, blob: bytes):
        return blob  # nothing is visible before the commit

    def discard_metadata(self, staged) -> None:
        pass

    def committed_by(self, staged) -> bool | None:
        """Whether ``.metadata`` holds these very bytes (a commit whose PUT landed though its
        answer was lost); None when the store cannot tell, which a cleanup takes for yes: the
        objects stay (strays at worst), never deleted under a ``.metadata`` that names them."""
        if staged is None:
            return False
        key = self.key(METADATA_FILE)
        try:
            size = self.store.size(key)
            return size == len(staged) and bytes(self.store.read_range(key, 0, size)) == bytes(staged)
        except StoreError:
            return None

    def files_of_committed(self) -> list[str]:
        """Our rank files the committed checkpoint names (to remove once replaced); nothing for a
        checkpoint that is not ours or cannot be read in safe mode."""
        try:
            with self.store.open_file(self.key(METADATA_FILE)) as f:
                metadata, _ = read_metadata_file(f)
            layout = metadata.storage_data
            if not isinstance(layout, CheckpointLayout):
                return []
            layout.validate(self.where(METADATA_FILE))
        except Exception:  # noqa: BLE001 - not ours, unreadable or damaged: remove nothing
            return []
        return layout_files(layout)

    def commit_metadata(self, staged: bytes, overwrite: bool) -> None:
        key = self.key(METADATA_FILE)
        if overwrite:
            self.store.replace_bytes(key, staged)  # one PUT: the old .metadata or the new, whole
            return
        try:
            self.store.put_new(key, staged)
        except ObjectExistsError:
            if self.committed_by(staged):  # a retry of a PUT that had landed: ours
                return
            raise CheckpointExistsError(
                f"{self.location}: another save committed a checkpoint there while this one was writing; "
                "this save was not committed and its objects were removed (pass "
                "DataStatesWriter(..., overwrite=True) to replace a committed checkpoint instead)"
            ) from None

    def after_commit(self, stale: list[str]) -> None:
        if not stale:
            return
        try:
            self.store.delete([self.key(f) for f in stale])
        except StoreError as exc:
            raise CheckpointError(
                f"{self.location} is committed (.metadata is in place), but removing the objects of the "
                f"checkpoint it replaced failed: {exc}; they remain (verify lists them as strays)"
            ) from exc

    def remove(self, names: list[str]) -> None:
        """Remove a failed save's objects; a store that does not answer leaves them (strays that
        verify lists and the next save's cleanup ignores), never hiding the save's own error."""
        try:
            self.store.delete([self.key(n) for n in names])
        except StoreError:
            pass
