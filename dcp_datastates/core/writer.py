"""DataStatesWriter: the StorageWriter (and AsyncStager) of dcp_datastates.

This module is the protocol surface: each DCP call in the order DCP makes it,
each a few lines that hand the work to the module that owns it.

Synchronous saves (``dcp.save``), per rank:
1. ``storage_meta`` begins the save (its turn in the order of saves,
   :mod:`save_order`);
2. ``prepare_global_plan`` (coordinator) fixes each rank's files, stripes
   and offsets (:mod:`layout`) after the planner deduplicated items;
3. ``write_data`` writes the rank's file (:mod:`rank_file`): the engine
   copies, checksums and writes while Python serializes the objects and, on
   the coordinator, the final metadata;
4. ``finish`` (coordinator) commits (:mod:`commit`): directory fsync, rename
   of the temporary metadata to ``.metadata``, directory fsync.

Asynchronous saves (``dcp.async_save``) start earlier: ``stage()`` captures a
lazy snapshot (:mod:`snapshot`, :mod:`stager`) that places the rank's tensors
in its own file and streams them through the engine's bounded pool while
training goes on, and returns a future that completes once every byte has
left the caller's tensors. DCP's thread takes that future and runs steps 1-4;
the plan only maps items to bytes the snapshot already placed. An error of a
background save fails its future and is raised again by the next save call
(:class:`save_state.BackgroundErrors`).

Saving into a directory that holds a committed checkpoint is refused unless
``overwrite=True``; an overwrite writes new files beside the old ones and
removes the old checkpoint's files only after the new ``.metadata`` is in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import uuid
import weakref
from typing import Any, Sequence

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_datastates import _dcp_compat
from dcp_datastates.core import incremental, plan_cache, rank_file
from dcp_datastates.core.destination import destination_of
from dcp_datastates.core.compression import descriptor_of, resolve_compression
from dcp_datastates.core.layout import (
    AUTO_STRIPE_MIN_BYTES,
    RankLayout,
    RankPlanData,
    StagedRankData,
    assign_checkpoint_layout,
    assign_staged_layout,
    has_staged_layout,
    new_save_id,
    plan_rank_layout,
    rank_layout_of,
)
from dcp_datastates.core.save_order import ORDER
from dcp_datastates.core.save_state import BACKGROUND_ERRORS, RankSave, SaveStats, new_writer_serial
from dcp_datastates.core.snapshot import Snapshot
from dcp_datastates.core.stager import WriterSnapshots
from dcp_datastates.core.staging import StagingFuture
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.metadata_file import encode_metadata
from dcp_datastates.format.file_names import MAX_STRIPES, METADATA_FILE, layout_files
from dcp_datastates.storage.url import check_location, is_store_url
from dcp_datastates.format.checkpoint_layout import CheckpointLayout, RankFiles
from dcp_datastates.native import engine as _native

__all__ = ["DataStatesWriter", "SaveStats"]


def _check_target(path, compression, base) -> None:
    """A ValueError for a destination no store serves, or for what a save straight into object
    storage does not do (naming what to use instead)."""
    if path is None:
        return
    check_location(path, "DataStatesWriter")
    if not is_store_url(path):
        return
    unsupported = [what for what, given in (("compression", compression is not None), ("base", base is not None)) if given]
    if unsupported:
        raise ValueError(
            f"DataStatesWriter({os.fspath(path)!r}, {', '.join(unsupported)}=...): a save straight into object "
            "storage writes raw, full checkpoints; for compressed or incremental checkpoints there, save them "
            "to a local directory and have them copied in the background: CheckpointManager(local_root, "
            "durable=URL, ...) (docs/tiers.md)"
        )


class DataStatesWriter(StorageWriter, AsyncStager):
    """Write DCP checkpoints as coalesced per-rank files through the native engine.

    Works with ``dcp.save`` and, as an ``AsyncStager``, with ``dcp.async_save``,
    whose ``stage()`` returns at once while the engine copies the state through
    ``host_cache_bytes`` of reused host memory.

    Args:
        path: checkpoint directory, or a URL of object storage
            (``s3://bucket/run/step_00000100``: each rank streams its files there
            by multipart upload from the engine's pool, ``.metadata`` last;
            endpoint and credentials as :mod:`storage.s3` takes them, or in
            ``store_options``). ``dcp.async_save`` stages before it passes
            ``checkpoint_id`` on, so asynchronous saves need the path here (or
            set by ``writer.reset(path)`` before ``dcp.async_save``).
        overwrite: allow saving over a committed checkpoint in ``path``.
        host_cache_bytes: bytes of reused host staging memory (the engine pool),
            shared by every writer with the same settings in the process.
        io_threads: threads that checksum and write windows.
        window_bytes: size of one write window (one pool slot, one pwrite).
        direct_io: ``"auto"`` (O_DIRECT where the filesystem allows it),
            ``"on"`` (require it) or ``"off"`` (buffered writes).
        sequence: a commit sequence number recorded in ``.metadata``'s trailer
            (0: none). :class:`CheckpointManager` numbers the commits in its
            root with it, so that resume orders them without clocks.
        compression: ``"zstd"`` stores every tensor chunk of 64 KiB or more as
            zstd frames of 4 MiB blocks (see :mod:`compression`); needs
            ``pip install "dcp_datastates[zstd]"``. ``None`` (default): raw.
        compression_level: the zstd level (default 3, DCP's).
        stripes: how many data files a rank of a synchronous save may write its
            tensors to, each from its own I/O thread (format 7; buffered
            writes to one file serialize on its inode lock, so on fast
            storage one file per thread is faster). ``None`` (default): up to
            ``io_threads``, and at most one per 32 MiB of the rank's tensors;
            ``1``: one file per rank. Stripes are cut at large tensors' starts,
            so a rank has at most as many as it has tensors of 64 KiB or more.
            Compressed saves and asynchronous snapshots write one file.
        _extensions: DCP's ``FileSystemWriter`` argument, accepted so that
            switching is one argument: ``[ZStandard()]`` means ``compression="zstd"``;
            any other extension is refused.
        base: a committed checkpoint in a sibling directory to save incrementally
            against (format 8, docs/incremental.md): each tensor chunk of 64 KiB
            or more whose bytes equal the base's chunk at the same key, offsets,
            dtype and shape (XXH3-128 digests, computed now and recorded by the
            base's save) is not written; the new checkpoint refers to the base's
            file, offset and checksums. The base must then be kept as long as
            the new checkpoint is (``CheckpointManager`` does this itself).
            ``None`` (default): a full save. Not with ``compression``.
        record_digests: record content digests of the large chunks (so that a
            later save can use this checkpoint as its base). On when ``base``
            is given; off by default otherwise (it costs a hash of every byte).
        change_tracker: an :class:`incremental.ChangeTracker` kept across saves:
            chunks whose tensors changed since its last save are written
            without hashing (``CheckpointManager`` passes its own).
        store_options: options of the object store a URL names (``endpoint``,
            ``region``, ``part_bytes``, retries: :class:`storage.s3.S3Store`).
        verify_upload: read every object of a save into object storage back
            once uploaded and compare its CRC-32C with the bytes sent (the save
            fails, uncommitted, if the store kept other bytes). On by default.

    A planner may set a truthy attribute ``resolve_creates_tensors`` when its
    ``resolve_data`` materialises a new tensor on every call (as the
    converter's does, reading each tensor from another checkpoint) instead of
    returning tensors the caller holds anyway. Synchronous saves then resolve
    and submit the tensors in batches of at most the host cache's bytes and
    let go of each batch once the engine has copied it, so memory stays
    bounded by one batch (or the largest tensor) plus the host cache.
    """

    _synchronize_after_execute = False  # stage() returns a future; the caller fences

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        overwrite: bool = False,
        host_cache_bytes: int = _native.DEFAULT_HOST_CACHE_BYTES,
        io_threads: int = _native.DEFAULT_IO_THREADS,
        window_bytes: int = _native.DEFAULT_WINDOW_BYTES,
        direct_io: str = "auto",
        sequence: int = 0,
        compression: str | None = None,
        compression_level: int | None = None,
        stripes: int | None = None,
        _extensions: Sequence[Any] | None = None,
        base: str | os.PathLike | None = None,
        record_digests: bool = False,
        change_tracker: incremental.ChangeTracker | None = None,
        store_options: dict | None = None,
        verify_upload: bool = True,
    ) -> None:
        super().__init__()
        if direct_io not in _native.DIRECT_IO_MODES:
            raise ValueError(f"direct_io must be one of {_native.DIRECT_IO_MODES}, got {direct_io!r}")
        # Before the codec is resolved: an impossible combination is named as such, also where
        # the codec's package is not installed.
        incremental.check_options(base, record_digests, compressed=compression is not None or bool(_extensions))
        _check_target(path, compression if compression is not None else (_extensions or None), base)
        self.compression = resolve_compression(compression, compression_level, _extensions)
        self.base = os.fspath(base) if base is not None else None
        if self.base is not None and path is not None:
            incremental.check_sibling(path, self.base)
        self.record_digests = bool(record_digests) or base is not None
        self.change_tracker = change_tracker
        self._io_threads = io_threads
        self.path = os.fspath(path) if path is not None else None
        self.store_options = dict(store_options or {})
        self.verify_upload = verify_upload
        self._destinations: dict[str, Any] = {}  # path -> its destination (a store is opened once)
        self.overwrite = overwrite
        self.direct_io = direct_io
        if not isinstance(sequence, int) or isinstance(sequence, bool) or not 0 <= sequence < 1 << 64:
            raise ValueError(f"sequence must be an integer in [0, 2**64), got {sequence!r}")
        self.sequence = sequence
        if stripes is not None and (not isinstance(stripes, int) or isinstance(stripes, bool) or not 1 <= stripes < MAX_STRIPES):
            raise ValueError(f"stripes must be None or an integer from 1 to {MAX_STRIPES - 1}, got {stripes!r}")
        # (max stripes, min bytes per stripe) for stripe_starts: the coordinator's reaches every rank.
        self._stripes = stripes
        # The engine belongs to a process: see the _engine property (forks).
        self._engine_ref = _native.ProcessEngine(host_cache_bytes, io_threads, window_bytes)
        _dcp_compat.quiet_discarded_dcp_debug_records()  # see README, "Performance"
        self.is_coordinator = False
        self.last_save_stats = SaveStats()
        self._serial = new_writer_serial()
        self._snapshots = WriterSnapshots()
        self._lock = threading.Lock()
        self._reset_paths: dict[int, str] = {}  # thread ident -> path DCP gave reset()
        self._save: RankSave | None = None  # the save in progress (or the last one)
        self._closed = False
        # DCP's id of the save (StorageMeta.save_id), as FileSystemWriter keeps it: made here and
        # by every reset(). Files are named by a separate id, new for every save.
        self.save_id = _new_dcp_id()
        _live_writers.add(self)

    @property
    def _engine(self):
        """This process's engine for the writer's settings (a writer made before a fork gets the
        child's own engine there: the parent's has no threads in the child)."""
        return self._engine_ref.get()

    def _settings(self) -> rank_file.WriteSettings:
        return rank_file.WriteSettings(self._engine, self.direct_io, self.compression)

    # -- AsyncStager protocol ---------------------------------------------------

    def stage(self, state_dict: Any) -> StagingFuture:
        """Start a lazy snapshot of ``state_dict`` and return at once.

        The returned future completes when every byte has left the caller's
        tensors (it is in the host pool or on disk); DCP's ``async_save`` turns
        it into ``AsyncSaveResponse.staging_completion``. Raises the error of
        an earlier background save that failed, if any, first.
        """
        if self._closed:
            raise RuntimeError("DataStatesWriter is closed")
        ORDER.leave_saves_of(threading.current_thread())
        BACKGROUND_ERRORS.raise_first()
        if self.path is None:
            raise ValueError(
                "DataStatesWriter needs its path before dcp.async_save stages the state: pass it to "
                "DataStatesWriter(path) (writers are cheap: they share the process-wide engine), or "
                "call writer.reset(path) before dcp.async_save"
            )
        dest = self._destination(self.path)
        if not self.overwrite:
            dest.refuse_committed()
        dest.prepare()
        snap = Snapshot(dest, _global_rank(), self.compression, self._snapshot_increment(self.path))
        return self._snapshots.stage(snap, state_dict, self._engine, self.direct_io)

    def _snapshot_increment(self, path: str) -> incremental.SnapshotIncrement | None:
        """What a snapshot into ``path`` hashes against (None: a full snapshot without digests)."""
        if not self.record_digests:
            return None
        if self.base is not None:
            incremental.check_sibling(path, self.base)
        return incremental.SnapshotIncrement(self.base, self.change_tracker, self._io_threads)

    def synchronize_staging(self) -> None:
        """Wait until every snapshot staged so far has left the caller's tensors."""
        self._snapshots.wait_staged()

    def abandon_unbegun(self, why: str = "the writer was told to give it up") -> int:
        """Give up every snapshot this writer staged whose save has not begun.

        For a ``dcp.async_save`` that raised after staging (its snapshot would
        otherwise hold every later save back until nothing refers to it any
        more): the snapshots' copies stop, their files are removed, and a save
        that still tries to begin one fails with :class:`CheckpointError`.
        Returns how many were given up. ``CheckpointManager`` calls it when a
        save fails.
        """
        return self._snapshots.abandon_unbegun(why)

    def close(self, timeout: float | None = None) -> None:
        """Wait for every save this writer staged to end, then raise any error they hit.

        A staged snapshot ends when DCP's background save of it has ended.
        ``timeout`` bounds the wait (``TimeoutError`` after it). ``close()`` is
        also ``AsyncStager.close``, which DCP asks callers to call after the
        last checkpoint.
        """
        me = threading.current_thread()
        ORDER.leave_saves_of(me)
        if not self._snapshots.wait_ended(timeout):
            raise TimeoutError(f"DataStatesWriter.close(): the saves staged into {self.path} did not end in {timeout} s")
        save = self._save
        if save is not None and save.thread is not me:
            if not ORDER.wait_ended(lambda t: t is save.ticket, timeout):
                raise TimeoutError(f"DataStatesWriter.close(): the save into {save.path} did not end in {timeout} s")
        if save is not None and not save.ended:  # a save DCP failed between our calls
            self._clean_up(save)
        self._closed = True
        BACKGROUND_ERRORS.raise_first(self._serial)

    def __enter__(self) -> DataStatesWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # The block failed, perhaps in a dcp.async_save after stage(): no save is coming
        # for a snapshot no thread took (one a save thread took goes on, and is waited for).
        self._snapshots.abandon_untaken(f"the with-block of its writer raised {exc_type.__name__}")
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the exception already propagating wins
            pass

    def __getstate__(self):
        # DCP's process-based executor pickles the writer into another process (in the
        # thread that took the staged dict), which has neither the snapshot nor its engine.
        why = "the writer was sent to another process"
        self._snapshots.abandon_taken_by(threading.current_thread(), why)
        raise TypeError(
            "DataStatesWriter cannot be sent to another process: use dcp.async_save with "
            "async_checkpointer_type=AsyncCheckpointerType.THREAD (the default); the native "
            "engine already copies and writes outside the GIL"
        )

    # -- StorageWriter protocol -------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Set the path of the next checkpoint (DCP calls this with ``checkpoint_id``).

        Like FileSystemWriter's, every call also gives the writer a new ``save_id``.
        """
        self.save_id = _new_dcp_id()
        if checkpoint_id is not None:
            _check_target(checkpoint_id, self.compression, self.base)
            self.path = os.fspath(checkpoint_id)
            with self._lock:
                self._reset_paths[threading.get_ident()] = self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            path = os.fspath(checkpoint_id)
        except TypeError:
            return False
        return isinstance(path, str) and ("://" not in path or is_store_url(path))

    def _striping_of(self, save: RankSave) -> tuple[int, int]:
        """(max stripes, min bytes per stripe) for ``layout.stripe_starts``. Into object storage one
        stripe unless asked: stripes parallelize a file system's writes, and each would be an upload
        of its own, with its parts in flight in memory; the store's upload has its own parallelism."""
        if self._stripes is not None:
            return (self._stripes, 0)
        if save.dest is not None and not save.dest.is_local:
            return (1, 0)
        return (self._io_threads, AUTO_STRIPE_MIN_BYTES)

    def _destination(self, path: str):
        """Where a save into ``path`` writes (a store is opened once per path and writer)."""
        dest = self._destinations.get(path)
        if dest is None:
            dest = self._destinations[path] = destination_of(path, self.store_options, self.verify_upload)
        return dest

    def storage_meta(self) -> StorageMeta | None:
        # DCP's first call of every save: the save begins here.
        save = self._begin_save()
        save.dcp_save_id = self.save_id
        return StorageMeta(checkpoint_id=save.path, save_id=save.dcp_save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        save = self._current()
        with self._failing(save):
            if kwargs.get("use_collectives") is False and _world_size() > 1:
                raise NotImplementedError(
                    "DataStatesWriter needs use_collectives=True when several ranks save: rank files "
                    "are assigned by the coordinator"
                )
            save.is_coordinator = self.is_coordinator = is_coordinator
            save.rank = int(kwargs.get("rank", _global_rank()))
            save.dest.prepare()
            # Checked again here (stage() did too): an earlier save may have committed since.
            if not self.overwrite:
                save.dest.refuse_committed()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        save = self._current()
        if not plan.usable:  # DCP's plan cache: the plan is the one an earlier save wrote
            save.stats.plan_from_cache = True
            return plan
        if not save.asynchronous:
            return plan
        with self._failing(save):
            snap = save.snapshot
            save.tensor_locations = snap.locations_for(plan.items)
            staged = StagedRankData(
                save.rank, snap.save_id, snap.data_file, snap.index_file, snap.tensor_bytes_end, save.tensor_locations,
                descriptor_of(snap.compression), dict(snap.item_references), dict(snap.item_digests),
            )
            return dataclasses.replace(plan, storage_data=staged)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save = self._current()
        with self._failing(save), self._gc_paused(save):
            save.rank_layouts = {}
            if any(not p.usable for p in plans):
                return self._prepare_cached_global_plan(save, plans)
            if has_staged_layout(plans):  # asynchronous: every rank already placed its tensors
                if any(p.storage_data.references or p.storage_data.digests for p in plans):
                    save.layout = None  # incremental: finish() builds it from the ranks' results
                    return plans
                save.layout = assign_staged_layout(plans, save.save_id)
                return plans
            if any(isinstance(p.storage_data, StagedRankData) for p in plans):
                raise CheckpointError("some ranks saved asynchronously and others not; every rank must use the same call")
            compression = descriptor_of(self.compression)
            plans, save.layout, layouts = assign_checkpoint_layout(plans, save.save_id, compression, self._striping_of(save))
            save.rank_layouts = {lay.rank: (lay, [item.index for item in p.items]) for lay, p in zip(layouts, plans)}
            return plans

    def _prepare_cached_global_plan(self, save: RankSave, plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's save-plan caching: unusable plans stand for plans cached by an earlier save.

        Those ranks write the cached final plan again, in files of their own
        (see :mod:`plan_cache`); changed synchronous plans get a layout as
        usual. The checkpoint's layout is built from the write results in
        ``finish``.
        """
        save.plan_cached = True
        save.layout = None
        if save.asynchronous:  # each rank's snapshot placed its tensors
            return plans
        sent = [p if p.usable else SavePlan([]) for p in plans]
        placed, _, _ = assign_checkpoint_layout(sent, save.save_id, descriptor_of(self.compression), self._striping_of(save))
        return [new if old.usable else old for old, new in zip(plans, placed)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._current()
        with self._failing(save), self._gc_paused(save):
            metadata_early = lambda: self._serialize_metadata_early(save, planner)  # noqa: E731
            if not save.is_coordinator:
                metadata_early = _nothing
            if save.asynchronous:
                if not isinstance(plan.storage_data, StagedRankData) or plan.storage_data.save_id != save.snapshot.save_id:
                    # DCP's plan cache: an earlier save's final plan; map its items to this snapshot
                    save.stats.plan_from_cache = True
                    save.tensor_locations = save.snapshot.locations_for(plan.items)
                results = rank_file.write_snapshot(save, plan, planner, self._settings(), metadata_early)
            else:
                layout = self._rank_layout(save, plan)
                increment = self._increment(save, plan, planner)
                if increment is not None:
                    # The written items are placed again without the referred ones; the layout
                    # is then built from every rank's results, so not serialized early.
                    plan = incremental.without_references(plan, increment)
                    layout = plan_rank_layout(plan.items, layout.rank, layout.save_id, layout.compression, layout.striping)
                    metadata_early = _nothing
                results = rank_file.write_planned(save, plan, planner, layout, self._settings(), metadata_early)
                if increment is not None:
                    results += [
                        WriteResult(index=index, size_in_bytes=chunk.length, storage_data=chunk.location())
                        for index, chunk in increment.references.items()
                    ]
                    save.report = incremental.report_increments(
                        save.report, increment.references.values(), increment.digests
                    )
            results.append(plan_cache.report_result(save.report))
            r = save.report
            save.stats.rank_files = RankFiles(save.rank, r.data_file, r.index_file, r.save_id, tuple(r.stripes))
        self.last_save_stats = save.stats
        if not save.is_coordinator:
            self._end(save)  # the coordinator commits; nothing more happens on this rank
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        save = self._current()
        t0 = time.perf_counter()
        with self._failing(save), self._gc_paused(save):
            results, reports = plan_cache.split_reports(results)
            layout = save.layout or metadata.storage_data
            if (save.plan_cached and save.layout is None) or plan_cache.has_increments(reports) or (
                isinstance(layout, CheckpointLayout) and not plan_cache.reports_match(layout, reports)
            ):
                # Plans from DCP's cache named an earlier save's files: what the ranks wrote decides.
                where = save.dest.where(METADATA_FILE)
                layout = save.layout = plan_cache.layout_from_results(results, reports, save.save_id, metadata, where)
                save.rank_layouts = {}
                self._discard_metadata_tmp(save)
            if not isinstance(layout, CheckpointLayout):
                raise CheckpointError("finish() called without a dcp_datastates layout (prepare_global_plan skipped?)")
            _check_results(save, layout, results)
            if metadata is not save.metadata_obj or save.metadata_tmp is None:
                # The planner did not expose its metadata early: serialize now.
                self._discard_metadata_tmp(save)
                self._write_metadata_tmp(save, metadata, layout)
            replaced = save.dest.files_of_committed() if self.overwrite else []  # read now: another save may have committed
            save.dest.commit_metadata(save.metadata_tmp, self.overwrite)
            # Committed from here on: nothing below may remove this checkpoint's files.
            save.metadata_tmp = None
            save.metadata_obj = None
            self._end(save)
        keep = set(layout_files(layout))
        save.dest.after_commit([f for f in replaced if f not in keep])
        save.stats.commit_s = time.perf_counter() - t0
        self.last_save_stats = save.stats

    # -- one save's life ----------------------------------------------------------

    def _begin_save(self) -> RankSave:
        """Pair the save with its snapshot (if its thread took one), wait for its turn, set it up."""
        me = threading.current_thread()
        snap = self._snapshots.take_for(me)
        with self._lock:
            given_path = self._reset_paths.pop(me.ident, None)
        if snap is not None:
            snap.begin()  # raises if it was given up meanwhile
            ticket = snap.ticket
        else:
            if self._closed:
                raise RuntimeError("DataStatesWriter is closed")
            ticket = ORDER.reserve()
        ORDER.begin(ticket)  # every earlier save has ended: no collective overlaps
        if snap is None:
            try:
                BACKGROUND_ERRORS.raise_first()  # a synchronous save is the next save call too
            except BaseException:
                ORDER.end(ticket)
                raise
        previous = self._save
        if previous is not None and not previous.ended:  # DCP failed between our calls of that save
            self._clean_up(previous)
        stats = SaveStats(asynchronous=snap is not None)
        path = snap.directory if snap is not None else self.path
        save = RankSave(
            path=path, dest=None, save_id=new_save_id(), thread=me, ticket=ticket, snapshot=snap, stats=stats,
            writer_serial=self._serial,
        )
        self._save = save
        if snap is not None:
            stats.stage_call_s = snap.stage_call_s
            stats.staged_s = snap.staged_s
        with self._failing(save):
            if path is None:
                raise ValueError("DataStatesWriter has no path: pass one or give dcp.save a checkpoint_id")
            save.dest = snap.dest if snap is not None else self._destination(path)
            if snap is not None and given_path is not None and not snap.dest.same_place(given_path):
                raise ValueError(
                    f"this save was staged into {snap.directory} (the writer's path when dcp.async_save "
                    f"called stage()), but DCP was given checkpoint_id={given_path!r}; set the path on the "
                    "writer before dcp.async_save: DataStatesWriter(path) or writer.reset(path)"
                )
        return save

    def _current(self) -> RankSave:
        save = self._save
        if save is None or save.thread is not threading.current_thread() or save.ended:
            raise CheckpointError(
                "DataStatesWriter was called outside a save (DCP calls storage_meta() first); "
                "one writer serves one save at a time"
            )
        return save

    @contextlib.contextmanager
    def _failing(self, save: RankSave):
        """On any error inside a writer call: clean up this save, remember the error."""
        try:
            yield
        except BaseException as exc:
            if not save.ended:
                self._clean_up(save)
                if save.asynchronous:
                    BACKGROUND_ERRORS.record(save.writer_serial, save.path, exc)
            raise

    @staticmethod
    def _gc_paused(save: RankSave):
        """Pause the cyclic GC (tens of thousands of small objects, no cycles) only in the caller's
        thread: a background save must not switch it off for the training loop meanwhile."""
        if save.asynchronous or _dcp_compat.runs_one_save(save.thread):
            return contextlib.nullcontext()
        return _native.gc_paused()

    def _end(self, save: RankSave) -> None:
        """The writer's part of the save is over (committed, or this rank's data written)."""
        save.ended = True
        save.job = None
        if save.snapshot is not None:
            save.snapshot.end()
        ORDER.end_unless_bound(save.ticket)

    def _clean_up(self, save: RankSave) -> None:
        """Remove the files of a save that will not commit."""
        committed = save.dest.committed_by(save.metadata_tmp) if save.dest is not None else False
        if committed:
            self._end(save)  # interrupted right after the rename (KeyboardInterrupt): committed, keep it
            return
        # Not committed, or (None) a store that cannot tell: then nothing is removed, since a
        # .metadata that landed would name these files (strays at worst).
        if save.snapshot is not None:
            save.snapshot.cancel("save failed", remove=committed is False)
        _native.stop_write_job(save.job, "save failed")
        self._end(save)
        if committed is False and save.dest is not None:
            save.dest.remove(save.written_files)
        self._discard_metadata_tmp(save)

    # -- placement and metadata -----------------------------------------------------

    def _rank_layout(self, save: RankSave, plan: SavePlan) -> RankLayout:
        """This rank's placement of a synchronous plan: the coordinator's own (computed once, in
        prepare_global_plan), the plan placed by the same rule on other ranks, or, for a plan DCP's
        cache returned, placed again in files of this save."""
        info = plan.storage_data
        if plan_cache.is_stale(info):
            save.stats.plan_from_cache = True
            # This writer's own compression: DCP's cache is per planner class and process, so
            # the cached plan may come from another writer (or from a FileSystemWriter save).
            layout = plan_cache.place_cached_plan(
                plan, info, save.rank, save.save_id, descriptor_of(self.compression), self._striping_of(save)
            )
            save.rank_layouts[layout.rank] = (layout, [item.index for item in plan.items])
            info = layout.plan_data()
        if not isinstance(info, RankPlanData):
            raise CheckpointError("save plan carries no dcp_datastates layout; was prepare_global_plan skipped?")
        plan_cache.mark_written(plan.storage_data)
        return rank_layout_of(plan, info, save.rank_layouts.get(info.rank))

    def _increment(self, save: RankSave, plan: SavePlan, planner: SavePlanner) -> incremental.RankIncrement | None:
        """This rank's incremental decisions for a synchronous plan (None: a full save without
        digests). Hashes the large chunks the base may hold, and those whose digests are recorded."""
        if not self.record_digests or getattr(planner, "resolve_creates_tensors", False):
            return None
        base = None
        if self.base is not None:
            base = incremental.BaseCheckpoint(self.base)
            base.check_sibling_of(save.path)
        increment = incremental.decide(plan, planner.resolve_data, base, self.change_tracker, self._io_threads)
        stats = save.stats
        stats.hashed_bytes, stats.referenced_bytes, stats.hash_s = (
            increment.hashed_bytes, increment.referenced_bytes, increment.hash_s,
        )
        return increment

    def _write_metadata_tmp(self, save: RankSave, metadata: Metadata, layout: CheckpointLayout) -> None:
        metadata.storage_data = layout
        metadata.storage_meta = StorageMeta(checkpoint_id=save.path, save_id=save.dcp_save_id)
        version = _dcp_compat.dcp_metadata_version()
        if version is not None:
            metadata.version = version
        save.metadata_tmp = save.dest.stage_metadata(layout.save_id, encode_metadata(metadata, self.sequence))
        save.metadata_obj = metadata

    def _serialize_metadata_early(self, save: RankSave, planner: SavePlanner) -> None:
        """Pickle and write the final metadata while the engine writes tensor bytes."""
        metadata = getattr(planner, "metadata", None)
        if not isinstance(metadata, Metadata):
            return  # finish() will serialize it
        if save.plan_cached:
            # Plans from DCP's cache: every rank places its cached plan again, by the rule the
            # layout follows, in files of this save; the coordinator's planner holds every
            # rank's global plan, so it can place them all now. finish() checks that each rank
            # wrote its items where this layout says (else the save fails).
            save.layout = self._layout_of_global_plans(save, getattr(planner, "global_plan", None))
        layout = save.layout or metadata.storage_data
        if not isinstance(layout, CheckpointLayout):
            return
        t = time.perf_counter()
        self._write_metadata_tmp(save, metadata, layout)
        save.stats.metadata_serialize_s = time.perf_counter() - t

    def _layout_of_global_plans(self, save: RankSave, plans) -> CheckpointLayout | None:
        """The layout this save's ranks write when DCP's cache gave them their plans: the
        coordinator's global plans placed in this save's files (None for an asynchronous save,
        whose snapshots placed the tensors, or where the planner keeps no global plans)."""
        if save.asynchronous or not isinstance(plans, list) or not plans:
            return None
        if not all(isinstance(p, SavePlan) and p.usable for p in plans):
            return None
        placed = {rank: lay for rank, (lay, _) in save.rank_layouts.items()}  # this rank's, placed for writing
        _, layout, layouts = assign_checkpoint_layout(
            plans, save.save_id, descriptor_of(self.compression), self._striping_of(save), placed
        )
        for lay, plan in zip(layouts, plans):
            save.rank_layouts.setdefault(lay.rank, (lay, [item.index for item in plan.items]))
        return layout

    def _discard_metadata_tmp(self, save: RankSave) -> None:
        if save.metadata_tmp is not None:
            save.dest.discard_metadata(save.metadata_tmp)
            save.metadata_tmp = None

    def _forget_parent_saves(self) -> None:
        """In a fork child: the saves this writer staged or ran in the parent go on
        (and are cleaned up) in the parent only; here the writer starts idle."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._snapshots._reset()
        self._reset_paths = {}
        self._save = None


def _check_results(save: RankSave, layout: CheckpointLayout, results: list[list[WriteResult]]) -> None:
    """Every rank wrote every item where the layout says (the coordinator's own placements
    when it has them: cheaper than the layout's lookup table)."""
    for rank, rank_results in enumerate(results):
        planned = save.rank_layouts[rank][0].locations if rank in save.rank_layouts else None
        for wr in rank_results:
            loc = planned.get(wr.index) if planned is not None else layout.location(wr.index)
            if loc != wr.storage_data:
                raise CheckpointError(f"write result for {wr.index.fqn!r} does not match its planned location")


# Writers alive in this process, so that a fork child can reset what they inherited.
_live_writers: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for writer in list(_live_writers):
        writer._forget_parent_saves()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _nothing() -> None:
    pass


def _new_dcp_id() -> str:
    """A save or load id the way DCP's FileSystemWriter/Reader make them (a uuid4 string)."""
    return str(uuid.uuid4())


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
