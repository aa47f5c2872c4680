"""Where a checkpoint's bytes live: one small protocol, a directory and an object store behind it.

A :class:`Store` holds named objects under one root (``step_00000010/.metadata``,
``step_00000010/rank00000-<id>.data``, ...): a directory tree
(:mod:`storage.local`: the engine's batched, verified ``pread`` for loads) or
a prefix of an S3 bucket (:mod:`storage.s3`). The readers, ``verify``, the
drain, the durable tier and the CLI work through it only, the way DCP's
``FileSystemReader`` composes ``self.fs``: it can write a whole object from a
stream (never whole in memory), write (or atomically replace) a small object,
read a byte range (also into a buffer), read many ranges verified against
their checksum segments (:meth:`Store.read_batch`), tell an object's size and
identity, list names under a prefix and delete names. An object becomes
visible under its name only when it is complete (a file is renamed into place
after an fsync; an S3 object exists only once its upload completed), which is
what lets a checkpoint commit there by writing its ``.metadata`` last.

Every failure is a :class:`StoreError` naming the store and the key.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import errno
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor, wait

from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.file_names import METADATA_FILE
from dcp_datastates.native import engine as _native
from dcp_datastates.storage.segments import SegmentChecker, SegmentMismatch

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


class ObjectExistsError(StoreError):
    """An object is already under the key a write must not replace (``put_new``)."""

    def __init__(self, *args) -> None:
        super().__init__(*args, transient=False)


class ShortObjectError(StoreError):
    """An object ended before the bytes asked of it: the object is damaged (a truncated file), not
    the store away; a load reports it as a truncated checkpoint file."""

    def __init__(self, *args) -> None:
        super().__init__(*args, transient=False)


@dataclasses.dataclass
class RangeRead:
    """One read of :meth:`Store.read_batch`: ``nbytes`` of object ``key`` from ``offset`` into the
    memory at ``address`` (kept alive by the caller), verified against ``index``'s checksum
    segments of ``stripe`` (which must tile it) or against ``checks`` (``(offset in the read,
    nbytes, crc32c)``, sorted), or not at all (neither given). ``data_offset``: where ``offset``
    lies in the rank's data, which the index's segments are at."""

    key: str
    offset: int
    nbytes: int
    address: int
    index: object = None  # a format.rank_index.RankIndex
    stripe: int = 0
    data_offset: int = 0
    checks: list | None = None


class Store(abc.ABC):
    """A tree of named objects under one root (see the module docstring).

    Keys are relative, ``/``-separated, never empty, never absolute, without
    ``.`` or ``..`` parts (:func:`check_key`).
    """

    url: str  # where the root is, as the user named it (a path or s3://bucket/prefix)
    read_block: int = 1 << 20  # the bytes a streamed read-back asks for at a time (a request each)
    # Whether writes are files of a file system, which several files written at once (a rank's
    # stripes) make faster; an object store's upload has a parallelism of its own.
    is_file_system: bool = False

    def make_prefix(self, prefix: str) -> None:
        """Make ``prefix`` ready to be written under (a directory, made durably); an object store
        has no directories."""

    def free_space(self, prefix: str) -> int | None:
        """The bytes that can still be written under ``prefix``; None where the store cannot tell
        (an object store: a write finds out)."""
        return None

    def put_in_place(self, key: str, data: bytes) -> None:
        """Write a small object under a name no other writer uses and nothing refers to yet (a
        save's rank index, named by the save's id, which only its ``.metadata`` makes part of a
        checkpoint): durable when this returns, but possibly visible before it is whole, as an
        engine write's files are. A file system's store writes it where it will be (the commit's
        directory fsync makes its name durable); an object store's objects are whole anyway."""
        self.put_bytes(key, data)

    def stage_bytes(self, key: str, data: bytes, staging_key: str | None = None) -> StagedBytes:
        """``data`` bound for ``key`` and not visible there until :meth:`StagedBytes.publish`:
        the two steps of a commit, so that a save's ``.metadata`` is ready while its data is
        written and appears in one step at the end. Held in memory here (an object appears whole
        in one PUT); a file system's store writes it durably under ``staging_key`` first."""
        return StagedBytes(self, key, bytes(data))

    @abc.abstractmethod
    def put_stream(self, key: str, blocks: Iterable[bytes], size: int | None, progress: Progress | None = None,
                   size_hint: int | None = None) -> None:
        """Write ``key`` from ``blocks`` (``size`` bytes in all, in order; None: not known
        beforehand, about ``size_hint``), visible only once complete. An exception raised by
        ``blocks`` abandons the object and propagates."""

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
    def put_new(self, key: str, data: bytes) -> None:
        """Write a small object only if there is none under ``key`` (:class:`ObjectExistsError`
        otherwise), atomically: of two writers racing, exactly one succeeds (a commit)."""

    def start_write(self, engine, key: str, regions, keep, **options):
        """An engine write job of the object ``key`` (the engine's ``Engine.write`` interface):
        written into a file where it will be (:class:`LocalStore`), or streamed into an object
        (:class:`upload.StreamUpload`, S3). A store that takes no engine writes refuses."""
        raise StoreError(f"{self.where(key)}: this store does not take engine writes")

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

    def read_blocks(self, key: str, size: int, block: int, start: int = 0) -> Iterator[tuple[int, bytes | bytearray | memoryview]]:
        """``(offset, bytes)`` of the object's ``size`` bytes from ``start``, ``block`` at a time
        (the read-back, the fetch and checksums stream whole objects through this)."""
        for at in range(start, start + size, block):
            yield at, self.read_range(key, at, min(block, start + size - at))

    def crc32c(self, key: str, start: int, end: int, crc: int = 0, pace: Callable[[], None] | None = None) -> int:
        """The CRC-32C of bytes ``[start, end)`` of the object, extending ``crc``: the one way a
        stored range is checksummed (a copy's read-back, a small file's check). Ranged reads of
        ``read_block``, ``read_concurrency`` in flight, each block checksummed on arrival and
        the block checksums joined in order (``crc32c_combine``); with ``pace``, one block at a
        time, ``pace()`` before each (a background copy's read-back stays out of a save's way).
        A store that can compute it where the bytes are overrides this."""
        block = self.read_block
        ranges = [(at, min(block, end - at)) for at in range(start, end, block)]
        crcs = [0] * len(ranges)

        def one(i: int) -> None:
            at, n = ranges[i]
            if pace is not None:
                pace()
            crcs[i] = _native.crc32c(self.read_range(key, at, n))

        if len(ranges) > 1 and pace is None:
            with ThreadPoolExecutor(min(self.read_concurrency, len(ranges)), thread_name_prefix="dcp_datastates-crc") as pool:
                run_all(pool, one, range(len(ranges)))
        else:
            for i in range(len(ranges)):
                one(i)
        for (_at, n), c in zip(ranges, crcs):
            crc = _native.crc32c_combine(crc, c, n)
        return crc

    def read(self, key: str) -> bytes:
        """A whole (small) object."""
        size = self.size(key)
        if size is None:
            raise StoreError(f"{self.where(key)}: no such object")
        return bytes(self.read_range(key, 0, size))

    def where(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    def identity(self, key: str) -> Hashable | None:
        """What tells this object from any other that was ever under ``key`` (a file's device,
        inode, size and times; an object's size, entity tag and modification time), so that a
        decode of it can be remembered; None: no such object."""
        size = self.size(key)
        return None if size is None else (key, size)

    def delete_checkpoint(self, prefix: str) -> None:
        """Remove the checkpoint under ``prefix`` so that no crash leaves it committed but partial:
        ``.metadata`` first (from then on it is an uncommitted leftover, which readers refuse and
        a cleanup removes), then everything else under it."""
        meta = f"{prefix}/{METADATA_FILE}"
        self.delete([meta])
        self.delete([k for k in self.list(f"{prefix}/") if k != meta])

    def missing_prefix(self, prefix: str) -> bool:
        """Whether nothing at all can be under ``prefix`` (a directory that does not exist); an
        object store, which has no directories, cannot tell and says False."""
        return False

    def open_file(self, key: str) -> StoredFile:
        """The object as a :class:`StoredFile` (bounded reads of a small file: ``.metadata``, a
        rank index); FileNotFoundError when there is none."""
        size = self.size(key)
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.where(key))
        return StoredFile(self, key, size)

    # ranged reads of an object store: each request waits milliseconds whatever its size, so
    # neighbours are merged and many are in flight; a file system's store overrides read_batch
    read_concurrency: int = 8  # ranged reads in flight
    range_bytes: int = 8 << 20  # the largest single ranged read; larger reads are split
    merge_gap_bytes: int = 1 << 20  # neighbouring reads this close are one request (the gap dropped)

    def read_batch(self, reads: list[RangeRead], *, threads: int | None = None) -> list:
        """Carry out every read; return the failures of the objects' bytes (the engine's
        ``ReadFailure`` records: ``"checksum"``, ``"truncated"``), in request order. A store that
        did not answer raises its :class:`StoreError`. Every byte read is verified as the read
        says (see :class:`RangeRead`) before this returns."""
        return _ranged_batch(self, reads, threads or self.read_concurrency)

    def close(self) -> None:
        """Release connections or handles (the store may not be used afterwards)."""


def metadata_key(checkpoint: str = "") -> str:
    """The key of the ``.metadata`` of the checkpoint under the key prefix ``checkpoint``."""
    return f"{checkpoint}/{METADATA_FILE}" if checkpoint else METADATA_FILE


def is_committed(store: Store, checkpoint: str = "") -> bool:
    """Whether the checkpoint under the key prefix ``checkpoint`` (``""``: the store's root) is
    committed: the one rule, for every store and every tier, that a checkpoint exists once its
    ``.metadata`` does (written last, never replaced in place). A file system's store refuses a
    ``.metadata`` that is not a regular file (a link) rather than answer."""
    return store.size(metadata_key(checkpoint)) is not None


def commit_checkpoint(store: Store, checkpoint: str, blob: bytes, *, replace: bool = False) -> None:
    """Commit the checkpoint under ``checkpoint`` by writing its ``.metadata`` ``blob``: the last
    step of every copy (a partner, durable or node copy), once everything ``blob`` names is
    durable; a save does the same in two steps (:meth:`Store.stage_bytes` while its data is
    written, ``publish`` at the end). Never over another commit unless ``replace``
    (:class:`ObjectExistsError`; these very bytes there already are this commit, retried)."""
    staged = store.stage_bytes(metadata_key(checkpoint), blob)
    try:
        staged.publish(replace=replace)
    finally:
        staged.abandon()  # nothing, once published; a refused commit leaves no temporary behind


def holds_bytes(store: Store, key: str, data: bytes) -> bool:
    """Whether ``key`` holds exactly ``data`` (how a retried commit tells its own bytes)."""
    return store.size(key) == len(data) and bytes(store.read_range(key, 0, len(data))) == bytes(data)


class StagedBytes:
    """A small object staged by :meth:`Store.stage_bytes`, held in memory until published."""

    def __init__(self, store: Store, key: str, data: bytes) -> None:
        self.store, self.key, self.data = store, key, data

    def publish(self, replace: bool = False) -> None:
        """Make the object visible under its key, whole, in one step: replacing one there only
        if ``replace``; otherwise :class:`ObjectExistsError` unless the object there holds these
        very bytes (a write that landed though its answer was lost)."""
        if replace:
            self.store.replace_bytes(self.key, self.data)
            return
        try:
            self.store.put_new(self.key, self.data)
        except ObjectExistsError:
            if not self.landed():
                raise

    def landed(self) -> bool | None:
        """Whether the key holds these very bytes (published); None when the store cannot tell,
        which a cleanup takes for yes: what the object names is kept (strays at worst)."""
        try:
            return holds_bytes(self.store, self.key, self.data)
        except StoreError:
            return None

    def abandon(self) -> None:
        """Give up the staged bytes (nothing to remove: they were never stored)."""


class StoredFile:
    """An object read in bounded pieces, as ``format`` reads a checkpoint's small files (the same
    methods as ``format.checkpoint_files.CheckpointFile``, a local file's)."""

    def __init__(self, store: Store, key: str, size: int) -> None:
        self.store, self.key, self.size = store, key, size
        self.path = store.where(key)  # as errors name it

    def __enter__(self) -> StoredFile:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def pread(self, nbytes: int, offset: int) -> bytes:
        return bytes(self.store.read_range(self.key, offset, nbytes))

    def crc32c(self, start: int, end: int, crc: int = 0) -> int:
        """CRC-32C of bytes ``[start, end)``, extending ``crc`` (:meth:`Store.crc32c`)."""
        return self.store.crc32c(self.key, start, end, crc)

    def read(self, nbytes: int, offset: int = 0) -> bytearray:
        buf = bytearray(nbytes)
        self.store.read_into(self.key, offset, memoryview(buf))
        return buf


@dataclasses.dataclass
class _Range:
    """One ranged read of the store: ``[start, end)`` of ``key``, feeding ``parts``
    (``(read number, offset in the read, offset in the range, length)``)."""

    key: str
    start: int
    end: int
    parts: list


def _plan_ranges(reads: list[RangeRead], limit: int, gap: int) -> tuple[list[_Range], list[int]]:
    """The reads as ranged reads: neighbours in one object merged, large ones split; and how many
    ranges feed each read."""
    ranges: list[_Range] = []
    pieces = [0] * len(reads)
    by_key: dict[str, list[int]] = {}
    for i, read in enumerate(reads):
        if read.nbytes:
            by_key.setdefault(read.key, []).append(i)
    for key, numbers in by_key.items():
        numbers.sort(key=lambda i: reads[i].offset)
        current: _Range | None = None
        for i in numbers:
            read = reads[i]
            end = read.offset + read.nbytes
            if read.nbytes > limit:
                for at in range(0, read.nbytes, limit):
                    n = min(limit, read.nbytes - at)
                    ranges.append(_Range(key, read.offset + at, read.offset + at + n, [(i, at, 0, n)]))
                pieces[i] = -(-read.nbytes // limit)
                continue
            if current is None or read.offset - current.end > gap or end - current.start > limit:
                current = _Range(key, read.offset, end, [])
                ranges.append(current)
            current.end = max(current.end, end)
            current.parts.append((i, 0, read.offset - current.start, read.nbytes))
            pieces[i] = 1
    return ranges, pieces


def verify_in_place(store: Store, read: RangeRead, checks: list, request: int, note: str = ""):
    """The bytes of ``read``, in its memory, against ``checks`` (:func:`checks_of`): None, or the
    engine's ``ReadFailure`` record (``request`` its number) for the first segment that does not
    match, ``note`` added to its message (where the bytes came from)."""
    if not checks:
        return None
    # at offsets in the object, as the engine reports them
    offsets, lengths, crcs = zip(*((read.offset + rel, n, c) for rel, n, c in checks))
    checker = SegmentChecker(offsets, lengths, crcs, store.where(read.key), "the object is corrupt")
    try:
        checker.feed(memory_at(read.address, read.nbytes), read.offset)
        checker.finish(read.offset + read.nbytes)  # every check lay inside the read
    except SegmentMismatch as exc:
        return _native.ReadFailure(request=request, kind="checksum", errno=errno.EIO, path=store.where(read.key),
                                   offset=exc.offset, message=exc.detail + note)
    return None


def checks_of(store: Store, read: RangeRead) -> list:
    """``(offset in the read, nbytes, crc32c)`` of the segments ``read`` is verified against."""
    if read.checks is not None:
        return read.checks
    if read.index is None:
        return []
    read.index.check_tiled(read.data_offset, read.nbytes, store.where(read.key), read.key)
    return read.index.checks_within(read.data_offset, read.nbytes)


def _ranged_batch(store: Store, reads: list[RangeRead], concurrency: int) -> list:
    checks = [checks_of(store, r) for r in reads]  # a range its segments do not tile fails here, unread
    ranges, pieces = _plan_ranges(reads, store.range_bytes, store.merge_gap_bytes)
    failures: list = []
    lock = threading.Lock()

    def verify(i: int) -> None:
        failure = verify_in_place(store, reads[i], checks[i], i)
        if failure is not None:
            with lock:
                failures.append(failure)

    def fill(rng: _Range) -> None:
        try:
            if len(rng.parts) == 1 and rng.parts[0][2] == 0 and rng.parts[0][3] == rng.end - rng.start:
                i, at, _, n = rng.parts[0]
                store.read_into(rng.key, rng.start, memory_at(reads[i].address + at, n))  # straight into place
            else:
                data = memoryview(store.read_range(rng.key, rng.start, rng.end - rng.start))
                for i, at, src, n in rng.parts:
                    memory_at(reads[i].address + at, n)[:] = data[src : src + n]
        except ShortObjectError as exc:
            with lock:
                failures.extend(_native.ReadFailure(
                    request=i, kind="truncated", errno=errno.EIO, path=store.where(rng.key), offset=rng.start, message=str(exc),
                ) for i, *_ in rng.parts)
            return
        for i, *_ in rng.parts:
            with lock:
                pieces[i] -= 1
                complete = pieces[i] == 0
            if complete:
                verify(i)

    if ranges:
        with ThreadPoolExecutor(min(concurrency, len(ranges)), thread_name_prefix="dcp_datastates-read") as pool:
            run_all(pool, fill, ranges)
    failures.sort(key=lambda f: f.request)
    return failures


_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory  # the stable C API: no ctypes type per length
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_memory_view.restype = ctypes.py_object
_PYBUF_WRITE = 0x200


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` at ``address`` (a destination the caller keeps alive)."""
    return _memory_view(address, nbytes, _PYBUF_WRITE)


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


