"""Where a checkpoint's bytes live: the storage layer every reader, verifier and tier composes.

:mod:`url` tells a URL from a directory and takes it apart; :mod:`store` is the
protocol (:class:`Store`); :mod:`local` a directory tree (the engine's batched,
verified reads), :mod:`s3` S3-compatible object storage; :mod:`segments`
checks streamed bytes against a rank index's checksum segments; :mod:`fsync_files`
holds the POSIX primitives every local write commits through (create and
fsync, directory fsync, renames that never replace).
"""

from __future__ import annotations

import os

from dcp_datastates.storage.store import (
    ObjectExistsError,
    RangeRead,
    ShortObjectError,
    Store,
    StoredFile,
    StoreError,
    commit_checkpoint,
    is_committed,
    metadata_key,
)
from dcp_datastates.storage.url import check_location, is_store_url

__all__ = ["ObjectExistsError", "RangeRead", "ShortObjectError", "Store", "StoreError", "StoredFile", "commit_checkpoint", "is_committed", "metadata_key",
           "open_store"]


def open_store(location: str | os.PathLike, **options) -> Store:
    """The store at ``location``: ``s3://bucket/prefix`` (S3-compatible object storage, see
    :mod:`storage.s3` for the endpoint and credentials and ``options``) or a directory path
    (:mod:`storage.local`; ``options``: ``io_threads``). Another scheme is a ValueError naming
    the supported ones."""
    check_location(location, "a store")
    if is_store_url(location):
        from dcp_datastates.storage.s3 import S3Store  # obstore is imported only for a URL

        return S3Store(os.fspath(location), **options)
    from dcp_datastates.storage.local import LocalStore

    return LocalStore(os.fspath(location), **options)
