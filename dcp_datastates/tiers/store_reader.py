"""StoreReader: load a checkpoint straight from a durable tier, with ranged reads.

A checkpoint on object storage (``s3://bucket/run/step_00000100``) can be
loaded without copying it to a local disk first: the load planner decides,
as for :class:`DataStatesReader`, which saved bytes each destination needs,
and this reader asks the store for exactly those byte ranges. Reads of
neighbouring items in one object are merged into one request (an object
store answers each request slowly, a few milliseconds, whatever its size),
large ones are split into ``range_bytes`` pieces, and ``concurrency``
requests are in flight at once. A range for one destination is read into it
directly; merged ranges go through a buffer and are copied out. Every
checksum segment a read covers is verified once all of its bytes have
arrived, before the tensor is handed to DCP, exactly as the local reader
verifies them.

Against fetching the checkpoint to local disk and loading it there, this
skips the local write, its fsync and the second read, and each rank reads
only the bytes its shards need (``bench_tiers.py``'s resume figures,
docs/benchmarks.md). It reads through the tier's :class:`DurableStore`, so
any store works; for a durable tier that is a directory, the local reader
on that directory is faster still (its native engine reads in parallel
without the interpreter), and the manager uses that.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor

from torch.distributed.checkpoint.metadata import Metadata

from dcp_datastates.core.reader import DataStatesReader, _ReadBatch, missing_rank_file
from dcp_datastates.errors import (
    ChecksumMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from dcp_datastates.format.checkpoint_layout import RankFiles
from dcp_datastates.format.file_names import METADATA_FILE, is_save_file
from dcp_datastates.format.metadata_file import TRAILER_BYTES, decode_metadata, sequence_in_tail
from dcp_datastates.format.rank_index import INDEX_HEADER, INDEX_TRAILER, IndexLimits, RankIndex, check_index_header, decode_index
from dcp_datastates.native.engine import crc32c
from dcp_datastates.tiers.s3_store import parse_s3_url
from dcp_datastates.tiers.store import DurableStore, StoreError, check_url_scheme, is_object_store_url, open_store, run_all

READ_CONCURRENCY = 8  # ranged reads in flight (each request to an object store waits milliseconds)
RANGE_BYTES = 8 << 20  # the largest single ranged read; larger reads are split
MERGE_GAP_BYTES = 1 << 20  # neighbouring reads this close are one request (the gap is read and dropped)


def split_checkpoint_url(url: str | os.PathLike) -> tuple[str, str]:
    """``(store root, key prefix)`` of a checkpoint's URL or directory: the store is opened at
    the checkpoint's parent, so that an incremental checkpoint's references to its siblings
    (``../<base>/<name>``) stay inside it, as a local reader resolves them in the parent
    directory. A checkpoint at a bucket's root (or ``/``) is its own store root (prefix
    ``""``; a reference out of it is refused). A URL the stores would refuse (another scheme,
    no bucket, empty, ``.`` or ``..`` parts) is a ValueError naming it."""
    check_url_scheme(url)
    if is_object_store_url(url):
        bucket, prefix = parse_s3_url(url)
        parent, _, name = prefix.rpartition("/")
        return f"s3://{bucket}" + (f"/{parent}" if parent else ""), name
    path = os.path.abspath(os.fspath(url))
    parent, name = os.path.split(path)
    return (parent, name) if name else (path, "")


class StoreReader(DataStatesReader):
    """Read a dcp_datastates checkpoint from a durable store, resharding through DCP.

    Args:
        path: the checkpoint's URL (``s3://bucket/prefix/step_00000100``, endpoint and
            credentials as :mod:`tiers.s3_store` takes them) or directory; with ``store``,
            the checkpoint's key prefix in that store (``step_00000100``).
        store: an open :class:`DurableStore` to read through (the manager passes its
            durable tier's); the reader does not close it. Without it, the reader opens
            the store at ``path``'s parent (so that an incremental checkpoint's bases,
            its siblings, can be read) with ``store_options``, and closes it in
            :meth:`close`.
        verify, allow_pickle: as for :class:`DataStatesReader`.
        concurrency: ranged reads in flight.
        range_bytes: the largest single ranged read.
    """

    _LOCAL_ONLY = False  # its paths are URLs (or directories, through a PosixStore)

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        store: DurableStore | None = None,
        store_options: dict | None = None,
        verify: bool = True,
        allow_pickle: bool = False,
        concurrency: int = READ_CONCURRENCY,
        range_bytes: int = RANGE_BYTES,
    ) -> None:
        if concurrency < 1 or range_bytes < 1:
            raise ValueError(f"concurrency and range_bytes must be positive, got {concurrency} and {range_bytes}")
        super().__init__(None, verify=verify, allow_pickle=allow_pickle)
        self._given_store = store
        self._store_options = dict(store_options or {})
        self._opened: DurableStore | None = None
        self._opened_for: str | None = None
        self._split_of: tuple[str, str, str] | None = None  # (path, store root, key prefix)
        self.concurrency = concurrency
        self.range_bytes = range_bytes
        self.commit_sequence: int | None = None  # the commit sequence .metadata records (read_metadata sets it)
        self._decoded_blob: tuple[bytes, bool, Metadata] | None = None
        if path is not None:
            self.reset(path)

    # -- the store and the checkpoint's keys in it -----------------------------------

    @property
    def store(self) -> DurableStore:
        if self._given_store is not None:
            return self._given_store
        root, _ = self._split()
        if self._opened is None or self._opened_for != self.path:
            self.close()
            self._opened, self._opened_for = open_store(root, **self._store_options), self.path
        return self._opened

    def _split(self) -> tuple[str, str]:
        """``split_checkpoint_url(path)``, once per path (a relative directory is resolved
        against the working directory once, at the path's first use, not at every read)."""
        if self.path is None:
            raise ValueError("StoreReader has no path: pass one or give dcp.load a checkpoint_id")
        if self._split_of is None or self._split_of[0] != self.path:
            self._split_of = (self.path, *split_checkpoint_url(self.path))
        return self._split_of[1], self._split_of[2]

    @property
    def prefix(self) -> str:
        """The checkpoint's key prefix in :attr:`store` (``""``: the store's root)."""
        if self._given_store is not None:
            if self.path is None:
                raise ValueError("StoreReader has no path: pass one or give dcp.load a checkpoint_id")
            return self.path.strip("/")
        return self._split()[1]

    def key(self, name: str) -> str:
        """The store key of the checkpoint's file ``name`` (``../<base>/<name>``: a file of a base
        checkpoint that an incremental checkpoint refers to, a sibling under the same prefix)."""
        prefix = self.prefix
        key = posixpath.normpath(f"{prefix}/{name}" if prefix else name)
        if key.startswith("../") or key == "..":
            raise CorruptCheckpointError(f"{self.location} refers to {name}, outside the store's root")
        return key

    def _where(self, name: str) -> str:
        return self.store.where(self.key(name))

    @property
    def location(self) -> str:
        prefix = self.prefix
        return self.store.where(prefix) if prefix else self.store.url

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.commit_sequence = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_object_store_url(checkpoint_id)

    def close(self) -> None:
        """Close the store this reader opened (not one it was given)."""
        if self._opened is not None:
            self._opened.close()
            self._opened = self._opened_for = None

    # -- the files, from the store ----------------------------------------------------

    def _fetch_metadata(self) -> Metadata:
        key = self.key(METADATA_FILE)
        store = self.store
        size = store.size(key)
        if size is None:
            raise self._missing_checkpoint_error()
        blob = bytes(store.read_range(key, 0, size))
        where = store.where(key)
        cached = self._decoded_blob
        if cached is not None and cached[0] == blob and cached[1] == self.allow_pickle:
            metadata = cached[2]
        else:
            metadata, _ = decode_metadata(blob, where, self.allow_pickle)
            self._decoded_blob = (blob, self.allow_pickle, metadata)
        self.commit_sequence = sequence_in_tail(blob[-TRAILER_BYTES:], len(blob), where) if len(blob) >= TRAILER_BYTES else None
        return metadata

    def _missing_checkpoint_error(self) -> Exception:
        prefix = self.prefix
        if not prefix:
            names, where = self.store.list(), self.store.url
        else:
            names = [k[len(prefix) + 1 :] for k in self.store.list(f"{prefix}/")]
            where = self.store.where(prefix)
        ours = [n for n in names if is_save_file(n)]
        if ours:
            return IncompleteCheckpointError(
                f"checkpoint at {where} is incomplete: it has {len(ours)} data/index object(s) but no "
                f"{METADATA_FILE}, so it was never committed there (a drain was interrupted or is running)"
            )
        return CheckpointNotFoundError(f"no checkpoint at {where}: {METADATA_FILE} is missing")

    def data_file_sizes(self, files: RankFiles) -> list[int]:
        sizes = []
        for name in files.data_paths():
            size = self.store.size(self.key(name))
            if size is None:
                raise missing_rank_file(self.location, files, "data", self._where(name))
            sizes.append(size)
        return sizes

    def _read_index(self, files: RankFiles, limits: IndexLimits) -> RankIndex:
        key = self.key(files.index_path)
        where = self.store.where(key)
        size = self.store.size(key)
        if size is None:
            raise missing_rank_file(self.location, files, "index", where)
        if size < INDEX_HEADER.size + INDEX_TRAILER.size:
            raise CorruptCheckpointError(f"rank index {where} is corrupt: {size} bytes is shorter than the header")
        # The header first: a hostile index is refused before it is read whole.
        header = INDEX_HEADER.unpack(bytes(self.store.read_range(key, 0, INDEX_HEADER.size)))
        check_index_header(header, size, where, limits)
        return decode_index(bytes(self.store.read_range(key, 0, size)), where, limits)

    def _new_batch(self) -> _StoreReadBatch:
        return _StoreReadBatch(self)


@dataclasses.dataclass
class _Read:
    """One request of a batch: ``nbytes`` of object ``key`` from ``offset`` into ``address``."""

    item_key: str  # the state-dict key it is for (errors name it)
    key: str
    offset: int
    nbytes: int
    address: int
    checks: list  # (offset in the read, length, crc32c) of the segments tiling it; [] unverified
    data_offset: int  # where the read starts in the rank's data (errors name it)
    pieces: int = 0  # ranged reads still to arrive into it


@dataclasses.dataclass
class _Range:
    """One ranged read of the store: ``[start, end)`` of ``key``, feeding ``parts``."""

    key: str
    start: int
    end: int
    parts: list  # (read, offset in the read, offset in the range, length)


class _StoreReadBatch(_ReadBatch):
    """A batch whose requests are ranged reads of the store (see the module docstring)."""

    def __init__(self, reader: StoreReader) -> None:
        super().__init__(reader)
        self.reads: list[_Read] = []

    def _request(self, key: str, relative_path: str, offset: int, nbytes: int, pointer: int, idx: RankIndex) -> None:
        reader = self.reader
        stripe, base, end = idx.stripe_of(offset) if idx.stripes else (0, 0, None)
        if stripe:
            relative_path = idx.stripe_files[stripe]
        where = reader._where(relative_path)
        if end is not None and offset + nbytes > end:
            raise CorruptCheckpointError(
                f"{where}: {key!r} (bytes {offset}..{offset + nbytes}) crosses the end of its stripe at {end} "
                "(the metadata is damaged)"
            )
        checks = []
        if reader.verify:
            idx.check_tiled(offset, nbytes, where, key)  # every byte read has its segment
            checks = idx.checks_within(offset, nbytes)
        self.reads.append(_Read(key, reader.key(relative_path), offset - base, nbytes, pointer, checks, offset))

    def _ranges(self) -> list[_Range]:
        """The reads as ranged reads of the store: neighbours in one object merged, large ones split."""
        limit = self.reader.range_bytes
        ranges: list[_Range] = []
        by_key: dict[str, list[_Read]] = {}
        for read in self.reads:
            by_key.setdefault(read.key, []).append(read)
        for key, reads in by_key.items():
            reads.sort(key=lambda r: r.offset)
            current: _Range | None = None
            for read in reads:
                end = read.offset + read.nbytes
                if read.nbytes > limit:
                    for at in range(0, read.nbytes, limit):
                        n = min(limit, read.nbytes - at)
                        ranges.append(_Range(key, read.offset + at, read.offset + at + n, [(read, at, 0, n)]))
                    read.pieces = -(-read.nbytes // limit)
                    continue
                if current is None or read.offset - current.end > MERGE_GAP_BYTES or end - current.start > limit:
                    current = _Range(key, read.offset, end, [])
                    ranges.append(current)
                current.end = max(current.end, end)
                current.parts.append((read, 0, read.offset - current.start, read.nbytes))
                read.pieces = 1
        return ranges

    def _read(self) -> None:
        reads = [r for r in self.reads if r.nbytes]
        if not reads:
            return
        self.reads = reads
        ranges = self._ranges()
        store = self.reader.store
        lock = threading.Lock()

        def fill(rng: _Range) -> None:
            try:
                if len(rng.parts) == 1 and rng.parts[0][2] == 0 and rng.parts[0][3] == rng.end - rng.start:
                    read, at, _, n = rng.parts[0]
                    store.read_into(rng.key, rng.start, _memory(read.address + at, n))  # straight into place
                else:
                    data = memoryview(store.read_range(rng.key, rng.start, rng.end - rng.start))
                    for read, at, src, n in rng.parts:
                        _memory(read.address + at, n)[:] = data[src : src + n]
            except StoreError as exc:
                keys = sorted({read.item_key for read, *_ in rng.parts})
                more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
                raise StoreError(f"{exc} (loading {', '.join(map(repr, keys[:3]))}{more})") from exc
            for read, *_ in rng.parts:
                with lock:
                    read.pieces -= 1
                    complete = read.pieces == 0
                if complete:
                    self._check(read)

        with ThreadPoolExecutor(min(self.reader.concurrency, len(ranges)), thread_name_prefix="dcp_datastates-load") as pool:
            run_all(pool, fill, ranges)

    def _check(self, read: _Read) -> None:
        """Verify every segment of a read whose bytes have all arrived."""
        if not read.checks:
            return
        memory = _memory(read.address, read.nbytes)
        for rel, length, expected in read.checks:
            actual = crc32c(memory[rel : rel + length])
            if actual != expected:
                raise ChecksumMismatchError(
                    f"{self.reader.store.where(read.key)} while reading {read.item_key!r}: checksum mismatch in the "
                    f"segment at data offset {read.data_offset + rel} ({length} bytes): {actual:08x} != {expected:08x}; "
                    "the object is corrupt"
                )


_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory  # the stable C API: no ctypes type per length
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_memory_view.restype = ctypes.py_object
_PYBUF_WRITE = 0x200


def _memory(address: int, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` at ``address`` (a destination tensor or buffer the batch keeps alive)."""
    return _memory_view(address, nbytes, _PYBUF_WRITE)
