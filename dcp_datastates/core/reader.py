"""DataStatesReader: the StorageReader of dcp_datastates.

DCP's load planner decides which saved chunks overlap which destination
shards (that is what lets a checkpoint saved on N ranks load on M). For every
such ReadItem this reader reads only the bytes it needs (:mod:`read_batch`),
and verifies every checksum segment a read covers (``verify=False`` skips that).

The reader composes a :class:`storage.Store`, as DCP's ``FileSystemReader``
composes ``self.fs``: a directory's (the engine's I/O threads read in parallel
and verify natively) or an object store's (``s3://``: ranged reads, merged and
in flight together). Everything above the store is the same code for both.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import time
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_datastates import _dcp_compat
from dcp_datastates.core import stock_dcp
from dcp_datastates.core.compression import transforms
from dcp_datastates.core.compression.codec import frame_undoer
from dcp_datastates.core import read_once
from dcp_datastates.core.read_once import READ_ONCE_MIN_BYTES
from dcp_datastates.core.read_batch import ReadBatch, ReadContext
from dcp_datastates.core.plan_rows import row_plan
from dcp_datastates.exchange.channel import DEFAULT_TIMEOUT_S, Channel, check_settings
from dcp_datastates.exchange.plan import Access
from dcp_datastates.exchange.reads import ReadSession
from dcp_datastates.native import engine as _native
from dcp_datastates.native.gc_pause import CallPause, main_thread_gc_paused
from dcp_datastates.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedFormatError,
)
from dcp_datastates.format.file_names import METADATA_FILE, is_save_file
from dcp_datastates.format.checkpoint_layout import CheckpointLayout, RankFiles, object_entries
from dcp_datastates.format.rank_index import IndexLimits, RankIndex
from dcp_datastates.format.checkpoint_files import read_rank_index
from dcp_datastates.format.metadata_file import read_commit_stamp, read_metadata_file
from dcp_datastates.storage import RangeRead, Store, open_store
from dcp_datastates.storage.url import check_location, is_store_url, split_parent, url_scheme

TEMP_BUDGET_BYTES = 512 << 20  # temporaries alive at once while reading non-direct items


class DataStatesReader(StorageReader):
    """Read dcp_datastates checkpoints, and stock DCP ones (``FileSystemWriter``'s, through
    :mod:`stock_dcp`), resharding to any world size through DCP.

    Its options (``path``, ``store``, ``store_options``, ``verify``,
    ``allow_pickle``, ``io_threads``, ``window_bytes``, ``concurrency``,
    ``_extension_registry``) are documented once, in README.md's "Options".
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        store: Store | None = None,
        store_options: dict | None = None,
        verify: bool = True,
        allow_pickle: bool = False,
        io_threads: int = _native.DEFAULT_READ_THREADS,
        window_bytes: int = _native.DEFAULT_WINDOW_BYTES,
        concurrency: int | None = None,
        read_once: bool = True,
        read_once_min_bytes: int = READ_ONCE_MIN_BYTES,
        exchange_timeout_s: float = DEFAULT_TIMEOUT_S,
        exchange_backend: str = "gloo",
        exchange: Channel | None = None,
        access: Access | None = None,
        _extension_registry: Any = None,
    ) -> None:
        super().__init__()
        if path is not None and store is None:
            check_location(path, type(self).__name__)
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be positive, got {concurrency}")
        check_settings(exchange_backend, exchange_timeout_s)
        self.path = os.fspath(path) if path is not None else None
        self.verify = verify
        if read_once_min_bytes < 0:
            raise ValueError(f"read_once_min_bytes must be 0 or more, got {read_once_min_bytes}")
        self.read_once, self.read_once_min_bytes = read_once, read_once_min_bytes
        self._exchange_settings = (exchange_timeout_s, exchange_backend)
        self._exchange, self._access = exchange, access  # a manager's channel, and who can read which file
        self._session: ReadSession | None = None  # this load's read-once rounds (read_data)
        self._gc_pause: CallPause | None = None  # a load's, from set_up_storage_reader to read_data
        self.allow_pickle = allow_pickle
        self.concurrency = concurrency
        self._given_store = store
        # A directory's store reads through the engine with these settings.
        self._local_options = {"io_threads": io_threads, "window_bytes": window_bytes}
        self._store_options = dict(store_options or {})
        _native.ProcessEngine(2 * window_bytes, io_threads, window_bytes)  # bad settings fail here
        self._opened: Store | None = None
        self._opened_for: str | None = None
        self._split_of: tuple[str, str, str] | None = None  # (path, store root, key prefix)
        _dcp_compat.quiet_discarded_dcp_debug_records()  # see README, "Performance"
        self._metadata: Metadata | None = None
        self._layout: CheckpointLayout | None = None
        # A stock DCP checkpoint's records ({MetadataIndex: _StorageInfo}, checked) instead of a
        # layout, and the DCP extensions that undo each transform chain they name (stock_dcp.py).
        self.stock: dict | None = None
        self.stock_chains: dict[tuple, list] = {}
        self._extension_registry = _extension_registry
        # How a frame of the layout's compression is undone (codec.frame_undoer); None: no frames.
        self.undo_frame = None
        # The last .metadata decoded, by the object's identity (Store.identity): reading the same
        # one again (a CheckpointManager check, then dcp.load's read_metadata) does not decode it.
        self._decoded: tuple[tuple, Metadata, int | None] | None = None
        self.commit_sequence: int | None = None  # what the decoded .metadata's trailer records
        self._indexes: dict[str, RankIndex] = {}
        self._chunks: dict[str, dict[tuple, Any]] = {}
        self._object_entries_of: tuple[CheckpointLayout | None, dict[int, int]] = (None, {})
        # DCP's id of this reader's load (StorageMeta.load_id), as FileSystemReader keeps it:
        # made here and by every reset(); read_metadata() stamps it into the metadata.
        self.load_id = str(uuid.uuid4())
        # What this reader's last load (set_up_storage_reader on) read: the bytes asked of the
        # store (segments widened to, gaps merged, compressed frames as stored) and the bytes
        # of the boxes the plan asked for; their ratio is the load's read amplification.
        self.bytes_read = 0
        self.bytes_needed = 0
        self.bytes_received = 0  # a read-once load: bytes other ranks read for this one and sent it
        if self.path is not None:
            self.require_checkpoint()

    @property
    def layout(self) -> CheckpointLayout | None:
        """The validated layout of the checkpoint read (its files and where each item is
        stored); None before :meth:`read_metadata`. Read-only: the reader relies on it."""
        return self._layout

    @property
    def extension_registry(self):
        """DCP's ``ExtensionRegistry`` that undoes stream transforms: the one given, or DCP's
        default (which knows ZStandard)."""
        if self._extension_registry is None:
            self._extension_registry = transforms.default_registry()
        return self._extension_registry

    # -- where the checkpoint is: a key prefix in a store --------------------------------

    @property
    def store(self) -> Store:
        """The store the checkpoint's files are read from."""
        if self._given_store is not None:
            return self._given_store
        root, _ = self._split()
        if self._opened is None or self._opened_for != self.path:
            self.close()
            options = self._store_options if is_store_url(root) else {**self._local_options, **self._store_options}
            self._opened, self._opened_for = open_store(root, **options), self.path
        return self._opened

    def _split(self) -> tuple[str | None, str]:
        """``(store root, key prefix)`` of ``path``, once per path (a relative directory is resolved
        against the working directory once, at the path's first use, not at every read); the
        root is None in a given store."""
        if self.path is None:
            raise ValueError(f"{type(self).__name__} has no path: pass one or give dcp.load a checkpoint_id")
        if self._split_of is None or self._split_of[0] != self.path:
            if self._given_store is None:
                self._split_of = (self.path, *split_parent(self.path))
            else:
                prefix = posixpath.normpath(self.path.strip("/") or ".")
                self._split_of = (self.path, None, "" if prefix == "." else prefix)
        return self._split_of[1], self._split_of[2]

    @property
    def prefix(self) -> str:
        """The checkpoint's key prefix in :attr:`store` (``""``: the store's root)."""
        return self._split()[1]

    def key(self, name: str) -> str:
        """The store key of the checkpoint's file ``name``; a base checkpoint's file
        (``../<base>/<name>``, format 8) is a sibling under the same parent, resolved lexically,
        never through a symbolic link's target."""
        prefix = self.prefix
        key = posixpath.normpath(f"{prefix}/{name}" if prefix else name)
        if key.startswith("../") or key == "..":
            raise CorruptCheckpointError(f"{self.location} refers to {name}, outside the store's root")
        return key

    def where(self, name: str) -> str:
        """The checkpoint file ``name`` as errors name it."""
        return self.store.where(self.key(name))

    @property
    def location(self) -> str:
        """The checkpoint as errors name it (its directory, or its URL)."""
        prefix = self.prefix
        return self.store.where(prefix) if prefix else self.store.url

    def close(self) -> None:
        """Close the store this reader opened (not one it was given)."""
        if self._opened is not None:
            self._opened.close()
            self._opened = self._opened_for = None

    # -- StorageReader protocol -------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._end_gc_pause()  # a load DCP abandoned between our calls (the next one begins here)
        self.load_id = str(uuid.uuid4())
        if checkpoint_id is not None:
            if self._given_store is None:
                check_location(checkpoint_id, type(self).__name__)
            self.path = os.fspath(checkpoint_id)
            self.require_checkpoint()
        self._metadata = None
        self._layout = None
        self.stock = None
        self.undo_frame = None
        self._indexes = {}
        self._chunks = {}
        self.commit_sequence = None

    def require_checkpoint(self) -> None:
        """Raise :class:`CheckpointNotFoundError` (or :class:`IncompleteCheckpointError`) now, where
        the path is given, if it holds no committed checkpoint: inside ``dcp.load`` the error would
        come after DCP's first collective, wrapped in its ``CheckpointException`` (a
        ``BaseException``), with DCP's own traceback on stderr. Every rank checks the path itself."""
        self._metadata_identity()

    def _metadata_identity(self):
        """The identity of the checkpoint's ``.metadata`` (:meth:`Store.identity`); a missing one
        is the checkpoint's absence or incompleteness, raised as such."""
        identity = self.store.identity(self.key(METADATA_FILE))
        if identity is None:
            raise missing_checkpoint_error(self.store, self.prefix)
        return identity

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        if is_store_url(checkpoint_id):
            return True
        try:
            path = os.fspath(checkpoint_id)
        except TypeError:
            return False
        return isinstance(path, str) and url_scheme(path) is None and os.path.isfile(os.path.join(path, METADATA_FILE))

    def read_metadata(self, *args: Any, **_options: Any) -> Metadata:
        """Decode and check ``.metadata``; every failure is a typed error naming the file.

        DCP before 2.13 catches any error of this call and raises only
        ``AssertionError("metadata is None")``; there the error is also logged
        (logger ``dcp_datastates.core.reader``, ERROR) so that ``dcp.load`` still says why.
        """
        # The catch-all is deliberately not named ``kwargs``: DCP 2.13 probes for
        # that name and would retry with per-rank metadata, which we never write.
        try:
            return self.load_metadata()
        except Exception as exc:
            if not _dcp_compat.dcp_load_reports_read_metadata_errors():
                log_unreported_error(exc)
            raise

    def load_metadata(self) -> Metadata:
        """Decode and check ``.metadata`` (once per file), raising a typed error naming the file:
        :meth:`read_metadata` for callers other than DCP. Sets :attr:`layout` and
        :attr:`commit_sequence`."""
        metadata = self._fetch_metadata()
        self._take_storage_data(metadata)  # ours validated by the decoding; a stock one checked here
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _take_storage_data(self, metadata: Metadata) -> None:
        """Keep ``metadata`` and what its storage data says: our layout, or a stock DCP
        checkpoint's records (``FileSystemWriter``'s, read by :mod:`stock_dcp`)."""
        md_path = self.where(METADATA_FILE)
        storage_data = metadata.storage_data
        self.undo_frame = None
        if isinstance(storage_data, CheckpointLayout):
            stock, chains = None, {}
            if storage_data.compression is not None:  # an extension the registry lacks fails here
                self.undo_frame = frame_undoer(storage_data.compression, self.extension_registry, md_path)
        else:
            stock = stock_dcp.stock_storage(storage_data, md_path)
            chains = stock_dcp.transform_chains(stock, self.extension_registry, md_path)
            storage_data = None
        self._metadata, self._layout, self.stock, self.stock_chains = metadata, storage_data, stock, chains

    def require_layout(self) -> CheckpointLayout:
        """:attr:`layout` after :meth:`load_metadata`, for what needs our format (the manager's
        steps, an incremental save's base): a stock DCP checkpoint, which the reader loads but
        which has no layout, is an :class:`UnsupportedFormatError` naming it."""
        if self._layout is None and self.stock is None:
            raise RuntimeError(f"{type(self).__name__}.require_layout() before load_metadata()")
        if self._layout is None:
            raise UnsupportedFormatError(
                f"{self.where(METADATA_FILE)}: a stock DCP checkpoint (FileSystemWriter's), not one of "
                "dcp_datastates: DataStatesReader loads it, but it cannot serve here"
            )
        return self._layout

    # -- the files, from the store ------------------------------------------------

    def _fetch_metadata(self) -> Metadata:
        """The decoded ``.metadata``, decoded once per object, not once per call: the object is
        known by its identity (a checkpoint saved again over the same path has a new
        ``.metadata``), taken before and after decoding; one that changed meanwhile is not
        remembered. A missing one is the checkpoint's absence or incompleteness."""
        key = self.key(METADATA_FILE)
        store = self.store
        before = self._metadata_identity()
        cached = self._decoded
        if cached is not None and cached[0] == (before, self.allow_pickle):
            self.commit_sequence = cached[2]
            return cached[1]
        try:
            with store.open_file(key) as f:
                metadata, _ = read_metadata_file(f, self.allow_pickle)
                stamp = read_commit_stamp(f)
                sequence = stamp.sequence or None if stamp is not None else None
        except FileNotFoundError:
            raise missing_checkpoint_error(store, self.prefix) from None
        self._decoded = ((before, self.allow_pickle), metadata, sequence) if store.identity(key) == before else None
        self.commit_sequence = sequence
        return metadata

    def data_file_sizes(self, files: RankFiles) -> list[int]:
        """The sizes of the rank's data files (one per stripe); a missing one is an error."""
        sizes = []
        for name in files.data_paths():
            size = self.store.size(self.key(name))
            if size is None:
                raise missing_rank_file(self.location, files, "data", self.where(name))
            sizes.append(size)
        return sizes

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # DCP plans the load next: collections held back until read_data is done (native/gc_pause.py).
        self._end_gc_pause()
        self._gc_pause = CallPause.begin()
        with self._ending_gc_pause_on_error():
            self.use_metadata(metadata)

    def use_metadata(self, metadata: Metadata) -> None:
        """Read by ``metadata`` (this checkpoint's, checked) from now on: what a load's set-up does,
        for reads without a DCP load (tools.checkpoint_view)."""
        if metadata is not self._metadata:
            if isinstance(metadata.storage_data, CheckpointLayout):
                metadata.storage_data.validate(self.where(METADATA_FILE))
            self._take_storage_data(metadata)
        self._indexes = {}
        self._chunks = {}
        self.bytes_read = self.bytes_needed = self.bytes_received = 0

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        with self._ending_gc_pause_on_error():
            # DCP gathers it: pickled as rows
            return read_once.tag_local_plan(row_plan(plan), self.read_once)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        with self._ending_gc_pause_on_error():
            tagged = read_once.tag_global_plans(plans, self._metadata, self.read_once_min_bytes)
            return [row_plan(p) for p in tagged]  # scattered: rows

    def _end_gc_pause(self) -> None:
        pause, self._gc_pause = self._gc_pause, None
        if pause is not None:
            pause.end()

    @contextlib.contextmanager
    def _ending_gc_pause_on_error(self):
        try:
            yield
        except BaseException:
            self._end_gc_pause()
            raise

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return self._read_data(plan, planner)
        finally:
            self._end_gc_pause()  # the load's last call: DCP's planning is over

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        t0, read_bytes = time.perf_counter(), 0
        self._session = session = read_once.session_for(plan, self._exchange, self._access, *self._exchange_settings)
        try:
            if session is not None and session.access is not None:
                self._fetch_indexes(plan, session)
            context = self.read_context()
            with main_thread_gc_paused():
                batch = ReadBatch(context)
                for item in plan.items:
                    batch.add(item, planner)
                    if batch.temp_bytes >= TEMP_BUDGET_BYTES:
                        batch.run(last=False)
                        read_bytes += batch.read_bytes
                        self.bytes_needed += batch.needed_bytes
                        batch = ReadBatch(context)
                batch.run(last=True)
                read_bytes += batch.read_bytes
                self.bytes_needed += batch.needed_bytes
            if session is not None:
                session.finish(self.store, self.concurrency)
                read_bytes = session.bytes_read
                self.bytes_received += session.bytes_received
        except BaseException:
            if session is not None:
                session.leave(self.store)  # the other ranks' rounds go on without this one's reads
            raise
        finally:
            self._session = None
        self.bytes_read += read_bytes
        if _log.isEnabledFor(logging.INFO):
            seconds = time.perf_counter() - t0
            got = f" (and {session.bytes_received} from other ranks, read once)" if session is not None else ""
            _log.info("read %d bytes of %d item(s) from %s%s in %.3f s (%.2f GB/s)", read_bytes, len(plan.items),
                      self.location, got, seconds, read_bytes / seconds / 1e9 if seconds > 0 else float("inf"))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _fetch_indexes(self, plan: LoadPlan, session: ReadSession) -> None:
        """A load whose ranks cannot all read every file (node-local roots): the rank indexes this
        rank needs and cannot read come from ranks that can, in a round of their own, and are
        kept by the store (``adopt``); each is checked as any index is when the reader decodes it."""
        wanted: dict[str, bytearray] = {}
        layout = self._layout
        if layout is not None:
            me = session.channel.rank
            for item in plan.items:
                loc = layout.location(item.storage_index)
                files = layout.files_of(loc.relative_path) if loc is not None else None
                key = self.key(files.index_path) if files is not None else None
                if key is not None and key not in wanted and session.access(me, key) is None:
                    size = self.store.size(key)
                    if size is not None:
                        wanted[key] = bytearray(size)
        reads = [RangeRead(key, 0, len(buf), _native.bytearray_address(buf)) for key, buf in wanted.items() if buf]
        failures = session.read(self.store, reads, last=False, threads=self.concurrency)
        if failures:
            f = failures[0]
            raise CorruptCheckpointError(f"{f.path}: fetching the rank index from the rank that holds it: {f.message}")
        for key, buf in wanted.items():
            self.store.adopt(key, bytes(buf))

    def read_context(self) -> ReadContext:
        """What this load's read batches use of the reader (its metadata decoded)."""
        return ReadContext(
            location=self.location, verify=self.verify, allow_pickle=self.allow_pickle, layout=self._layout,
            tensors=self._metadata.state_dict_metadata, stock=self.stock, stock_chains=self.stock_chains,
            undo_frame=self.undo_frame, key=self.key, where=self.where, stored_at=self.stored_at,
            rank_index=self.rank_index, chunk_sizes=self.chunk_sizes, read_ranges=self.read_ranges,
        )

    def read_ranges(self, reads: list, last: bool = True) -> list:
        """Carry out a batch's reads (:meth:`Store.read_batch`'s answer): through this load's
        read-once rounds when it has them, else from the store."""
        if self._session is None:
            return self.store.read_batch(reads, threads=self.concurrency) if reads else []
        return self._session.read(self.store, reads, last=last, threads=self.concurrency)

    # -- helpers ----------------------------------------------------------------

    def rank_index(self, relative_path: str) -> RankIndex:
        """The index of the rank whose data file is ``relative_path`` (loaded once, validated).

        The data file is looked at first: its size, and the objects the layout
        places in the rank, bound what the index may claim
        (:func:`checkpoint_files.read_rank_index` refuses a hostile index by
        its header and checksum before reading it whole).
        """
        idx = self._indexes.get(relative_path)
        if idx is not None:
            return idx
        files = self._layout.files_of(relative_path)
        if files is None:
            raise CorruptCheckpointError(f"{self.location}: metadata names data file {relative_path} of no rank")
        # Every data file (one per stripe) must be there; the data may reach as far as the
        # last one's start plus its size, and every other stripe's file must hold its share.
        data_names = files.data_paths()
        bases = [0, *files.stripes]
        sizes = self.data_file_sizes(files)
        for k in range(len(bases) - 1):
            if sizes[k] < bases[k + 1] - bases[k]:
                raise CorruptCheckpointError(
                    f"data file {self.where(data_names[k])} is truncated: {sizes[k]} bytes, its stripe holds {bases[k + 1] - bases[k]}"
                )
        # A base rank's objects are its own checkpoint's: none are referred to, and its index may
        # list any number of them (each at least a byte of its data).
        objects = sum(sizes) if files.base else self._object_entries()[files.rank]
        limits = IndexLimits(self.where(data_names[-1]), sizes[-1], objects, bases[-1])
        index_path = self.where(files.index_path)
        try:
            with self.store.open_file(self.key(files.index_path)) as f:
                idx = read_rank_index(f, limits)  # its header and checksum checked before it is read whole
        except FileNotFoundError:
            raise missing_rank_file(self.location, files, "index", index_path) from None
        idx.apply_stripes(data_names, files.stripes, index_path)
        expected_sid = files.files_save_id(self._layout.save_id)
        if idx.save_id != expected_sid or idx.rank != files.rank:
            if files.base:
                raise CorruptCheckpointError(
                    f"{self.location} refers to rank {files.rank} of save {expected_sid} in base checkpoint "
                    f"{files.base!r}, but {index_path} belongs to rank {idx.rank} of save {idx.save_id}: the base "
                    "was saved again or replaced since, so the bytes referred to are gone"
                )
            raise CorruptCheckpointError(
                f"{index_path} belongs to rank {idx.rank} of save {idx.save_id}, expected rank "
                f"{files.rank} of save {expected_sid} (files from different checkpoints mixed?)"
            )
        self._indexes[relative_path] = idx
        return idx

    def _object_entries(self) -> dict[int, int]:
        """``format.object_entries`` of the current layout (computed once per layout)."""
        if self._object_entries_of[0] is not self._layout:
            self._object_entries_of = (self._layout, object_entries(self._layout))
        return self._object_entries_of[1]

    def stored_at(self, idx: RankIndex, relative_path: str, offset: int) -> tuple[str, int, int, int | None]:
        """Where data offset ``offset`` of the rank whose data file is ``relative_path`` is stored:
        ``(file name, stripe, the stripe's first data offset, its end)``; the end is None for a
        rank of one file."""
        if not idx.stripes:
            return relative_path, 0, 0, None
        stripe, base, end = idx.stripe_of(offset)
        return idx.stripe_files[stripe], stripe, base, end

    def chunk_sizes(self, index: MetadataIndex) -> tuple[torch.dtype, tuple[int, ...]]:
        md = self._metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{self.location}: {index.fqn!r} is not a tensor in the metadata")
        table = self._chunks.get(index.fqn)
        if table is None:
            table = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
            self._chunks[index.fqn] = table
        sizes = table.get(tuple(index.offset or ()))
        if sizes is None:
            raise CorruptCheckpointError(f"{self.location}: no saved chunk of {index.fqn!r} at offset {tuple(index.offset)}")
        return md.properties.dtype, sizes


_log = logging.getLogger(__name__)


def log_unreported_error(exc: BaseException) -> None:
    """Log an error DCP is known to swallow (it stays attached to the record as ``error``)."""
    _log.error("dcp_datastates: %s: %s", type(exc).__name__, exc, extra={"error": exc})


def missing_rank_file(location: str, files: RankFiles, kind: str, path: str) -> CorruptCheckpointError:
    """The error for a rank file that is not there: the checkpoint is damaged, or (a base rank's
    file, format 8) the base checkpoint it refers to was deleted."""
    if files.base:
        return CorruptCheckpointError(
            f"{location} refers to base checkpoint {files.base!r}, but rank {files.rank}'s {kind} file "
            f"{path} is missing (was the base deleted?); the checkpoint cannot be loaded without it"
        )
    return CorruptCheckpointError(f"rank {files.rank}'s {kind} file {path} is missing; the checkpoint is damaged")


def missing_checkpoint_error(store: Store, prefix: str) -> Exception:
    """The error for a checkpoint without ``.metadata``: none at all, or an interrupted save's
    files (a save into a directory, or a drain into a store, that never committed)."""
    where = store.where(prefix)
    if store.missing_prefix(prefix):
        return CheckpointNotFoundError(f"no checkpoint at {where}: the directory does not exist")
    ours = [n for n in names_under(store, prefix) if is_save_file(n)]
    if ours:
        return IncompleteCheckpointError(
            f"checkpoint at {where} is incomplete: it has {len(ours)} data/index file(s) "
            f"but no {METADATA_FILE}, so it was never committed (the save was interrupted or "
            "failed, or a copy there is still being made); its data cannot be trusted"
        )
    return CheckpointNotFoundError(f"no checkpoint at {where}: {METADATA_FILE} is missing")


def names_under(store: Store, prefix: str) -> list[str]:
    """The names of the files under the checkpoint ``prefix`` of ``store`` (``""``: its root)."""
    return [k[len(prefix) + 1 :] for k in store.list(f"{prefix}/")] if prefix else store.list()
