"""Storage tiers beyond the local checkpoint directory (issue 16).

A checkpoint commits on a fast local tier (a directory, as every save does);
a durable tier (a shared file system, or S3-compatible object storage) takes
copies of committed checkpoints. :mod:`store` is the one small interface the
rest of the package uses for a durable destination; :mod:`posix_store` and
:mod:`s3_store` implement it; :mod:`drain` copies checkpoints there and back, and
:mod:`store_reader` loads one straight from a store.
"""

from dcp_datastates.tiers.store import DurableStore, StoreError, open_store

__all__ = ["DurableStore", "StoreError", "open_store"]
