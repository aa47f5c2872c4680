"""The durable destination of a checkpoint copy: one small interface, two implementations.

A durable tier holds checkpoints as a tree of named objects under one root
(``step_00000010/.metadata``, ``step_00000010/rank00000-<id>.data``, ...):
a directory on a shared file system, or a prefix of an S3 bucket. The drain
needs only what both can do well: write a whole object from a local file
(streamed, never whole in memory), write (or atomically replace) a small object, read a byte range,
tell an object's size, list names under a prefix and delete names. An
object becomes visible under its name only when it is complete (a file is
renamed into place after an fsync; an S3 object exists only once its upload
completed), which is what lets a checkpoint commit there by writing its
``.metadata`` last.

Every failure is a :class:`StoreError` naming the destination and the key.
"""

from __future__ import annotations

import abc
import errno
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, wait

from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.file_names import url_scheme

Progress = Callable[[int], None]  # called with the bytes handed on since the last call


# A store on a file system that answers with one of these may answer again later (a network
# file system's server away, an I/O error a remount clears): the drain retries it.
_TRANSIENT_ERRNOS = {
    errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.EAGAIN, errno.EINTR, errno.EHOSTDOWN, errno.EHOSTUNREACH,
    errno.ENETDOWN, errno.ENETUNREACH, errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED,
    errno.ENOLINK, errno.ECOMM, errno.EREMOTEIO,
}


class StoreError(CheckpointError, OSError):
    """A durable store refused or failed an operation; the message names the store and the key.

    ``transient``: whether the store did not answer (an outage, which a later try may get
    past) rather than refused what it was asked (permissions, a missing object, a full or
    read-only file system). A store says so where it raises; otherwise it is told by the
    ``errno`` of the ``OSError`` that caused it."""

    def __init__(self, *args, transient: bool | None = None) -> None:
        super().__init__(*args)
        self._transient = transient

    @property
    def transient(self) -> bool:
        if self._transient is not None:
            return self._transient
        cause = self.__cause__
        return isinstance(cause, OSError) and not isinstance(cause, StoreError) and cause.errno in _TRANSIENT_ERRNOS


class DurableStore(abc.ABC):
    """A tree of named objects under one root (see the module docstring).

    Keys are relative, ``/``-separated, never empty, never absolute, without
    ``.`` or ``..`` parts (:func:`check_key`).
    """

    url: str  # where the root is, as the user named it (a path or s3://bucket/prefix)
    read_block: int = 1 << 20  # the bytes a streamed read-back asks for at a time (a request each)

    @abc.abstractmethod
    def put_stream(self, key: str, blocks: Iterable[bytes], size: int, progress: Progress | None = None) -> None:
        """Write ``key`` from ``blocks`` (``size`` bytes in all, in order), visible only once
        complete. An exception raised by ``blocks`` abandons the object and propagates."""

    def put_file(self, key: str, local_path: str, progress: Progress | None = None, block: int = 8 << 20) -> int:
        """Copy the local file to ``key`` (visible only once complete); return its size."""
        try:
            size = os.path.getsize(local_path)
        except OSError as exc:
            raise StoreError(f"copying {local_path} to {self.where(key)}: {exc.strerror or exc}") from exc

        def blocks():
            with open(local_path, "rb", buffering=0) as f:
                while data := f.read(block):
                    yield data

        try:
            self.put_stream(key, blocks(), size, progress)
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"copying {local_path} to {self.where(key)}: {exc.strerror or exc}") from exc
        return size

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object (visible only once complete)."""

    @abc.abstractmethod
    def replace_bytes(self, key: str, data: bytes) -> None:
        """Write a small object that may replace one under ``key``: a reader sees the old
        object or the new one whole, never neither (the tier's mirrored pointer)."""

    @abc.abstractmethod
    def read_range(self, key: str, offset: int, length: int) -> bytes | bytearray | memoryview:
        """``length`` bytes of ``key`` from ``offset`` (a bytes-like object, not copied again:
        the drain and ``verify`` read gigabytes through it); a short object is an error."""

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with ``len(out)`` bytes of ``key`` from ``offset`` (a load straight from the
        store reads into its destination tensors through this); a short object is an error."""
        out[:] = self.read_range(key, offset, len(out))

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None if there is no object ``key``."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (a key prefix ending in ``/``, or ``""``), sorted."""

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Remove these keys; a key already gone is not an error."""

    def read_blocks(self, key: str, size: int, block: int) -> Iterator[tuple[int, bytes | bytearray | memoryview]]:
        """``(offset, bytes)`` of the object's first ``size`` bytes, ``block`` at a time (the
        read-back, the fetch and ``verify`` stream whole objects through this)."""
        for at in range(0, size, block):
            yield at, self.read_range(key, at, min(block, size - at))

    def read(self, key: str) -> bytes:
        """A whole (small) object."""
        size = self.size(key)
        if size is None:
            raise StoreError(f"{self.where(key)}: no such object")
        return bytes(self.read_range(key, 0, size))

    def where(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    def close(self) -> None:
        """Release connections or handles (the store may not be used afterwards)."""


def run_all(pool: Executor, fn: Callable, items: Iterable) -> None:
    """``fn(item)`` for every item on ``pool`` (ranged reads in flight); the first failure
    cancels the calls not begun, waits for those running, and is raised."""
    futures = [pool.submit(fn, item) for item in items]
    try:
        for fut in futures:
            fut.result()
    except BaseException:
        for fut in futures:
            fut.cancel()
        wait(futures)
        raise


def check_key(key: str) -> str:
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"a store key must be a non-empty relative name, got {key!r}")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"a store key may not hold empty, '.' or '..' parts: {key!r}")
    return key


def is_object_store_url(url: str | os.PathLike) -> bool:
    return isinstance(url, str) and url.startswith("s3://")


def check_url_scheme(url: str | os.PathLike) -> None:
    """A ValueError for a URL of a scheme no store serves (``gs://``, ``S3://``, ``file://``):
    never taken for a directory whose name holds ``:``."""
    if url_scheme(url) is not None and not is_object_store_url(url):
        raise ValueError(f"unsupported durable tier URL {url!r}: use a directory path or s3://bucket/prefix")


def open_store(url: str | os.PathLike, **options) -> DurableStore:
    """The store at ``url``: ``s3://bucket/prefix`` (S3-compatible object storage, see
    :mod:`s3_store` for the endpoint and credentials) or a directory path (a shared file
    system, :mod:`posix_store`)."""
    check_url_scheme(url)
    if is_object_store_url(url):
        from dcp_datastates.tiers.s3_store import S3Store

        return S3Store(url, **options)
    from dcp_datastates.tiers.posix_store import PosixStore

    return PosixStore(os.fspath(url), **options)
