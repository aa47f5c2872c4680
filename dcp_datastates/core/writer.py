"""DataStatesWriter: the StorageWriter (and AsyncStager) of dcp_datastates.

This module is the protocol surface: each DCP call in the order DCP makes it,
each a few lines that hand the work to the module that owns it.

Synchronous saves (``dcp.save``), per rank:
1. ``storage_meta`` begins the save (its turn in the order of saves,
   :mod:`async_save.order`);
2. ``prepare_global_plan`` (coordinator) sends every rank the save's
   :class:`placement.PlacementRule` (file names, compression, stripes) after
   the planner deduplicated items;
3. ``write_data`` places the rank's items by that rule (:mod:`placement`) and
   writes its files (:mod:`rank_file`): the engine copies, checksums and
   writes while Python serializes the objects and, on the coordinator, the
   final metadata with the layout it predicts (:mod:`coordinator_layout`);
   the rank reports its files with its results (:mod:`rank_reports`);
4. ``finish`` (coordinator) keeps the predicted layout if the reports confirm
   it (else builds it from them) and commits through its :mod:`destination`:
   the staged metadata published as ``.metadata`` without replacing one (a
   directory: fsync, rename, fsync; object storage: a create-only PUT).

Asynchronous saves (``dcp.async_save``) start earlier: ``stage()`` captures a
lazy snapshot (:mod:`async_save`) that places the rank's tensors
in its own file and streams them through the engine's bounded pool while
training goes on, and returns a future that completes once every byte has
left the caller's tensors. DCP's thread takes that future and runs steps 1-4;
the plan only maps items to bytes the snapshot already placed. An error of a
background save fails its future and is raised again by the next save call
(:class:`async_save.runtime.BackgroundErrors`).

Saving into a directory that holds a committed checkpoint is refused unless
``overwrite=True``; an overwrite writes new files beside the old ones and
removes the old checkpoint's files only after the new ``.metadata`` is in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any, Sequence

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_datastates import _dcp_compat
from dcp_datastates.core import incremental, rank_file, save_metadata
from dcp_datastates.core.coordinator_layout import layout_from_reports
from dcp_datastates.core.destination import destination_of
from dcp_datastates.core.compression.codec import descriptor_of, resolve_compression
from dcp_datastates.core.placement import (
    AUTO_STRIPE_MIN_BYTES,
    PlacementRule,
    StagedRankData,
    new_save_id,
    place_rank,
    rule_to_place,
)
from dcp_datastates.core.rank_reports import item_entry, rank_results, split_reports
from dcp_datastates.core.async_save.handoff import StagingFuture, WriterSnapshots
from dcp_datastates.core.async_save.runtime import new_writer_serial, runtime
from dcp_datastates.core.async_save.snapshot import Snapshot
from dcp_datastates.core.save_state import RankSave, SaveStats, SaveTarget, log_rank_written
from dcp_datastates.core.plan_rows import row_plan
from dcp_datastates.errors import CheckpointError
from dcp_datastates.format.file_names import MAX_STRIPES, METADATA_FILE, layout_files
from dcp_datastates.storage.url import check_save_target, is_store_url
from dcp_datastates.format.checkpoint_layout import RankFiles
from dcp_datastates.native import engine as _native
from dcp_datastates.native.gc_pause import CallPause, main_thread_gc_paused

__all__ = ["DataStatesWriter", "SaveStats"]


class DataStatesWriter(StorageWriter, AsyncStager):
    """Write DCP checkpoints as coalesced per-rank files through the native engine.

    Works with ``dcp.save`` and, as an ``AsyncStager``, with ``dcp.async_save``,
    whose ``stage()`` returns at once while the engine copies the state through
    ``host_cache_bytes`` of reused host memory.

    Its options (``path``, ``overwrite``, ``host_cache_bytes``, ``io_threads``,
    ``window_bytes``, ``checksum_bytes``, ``direct_io``, ``compression``, ``compression_level``,
    ``_extensions``, ``sequence``, ``stripes``, ``base``, ``record_digests``,
    ``change_tracker``, ``store_options``, ``verify_upload``) are documented once,
    in README.md's "Options".

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
        checksum_bytes: int | None = _native.DEFAULT_CHECKSUM_BYTES,
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
        check_save_target(path, compression if compression is not None else (_extensions or None), base)
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
        _native.check_checksum_bytes(checksum_bytes, window_bytes)
        self._engine_ref = _native.ProcessEngine(host_cache_bytes, io_threads, window_bytes, checksum_bytes)
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
        runtime().writers.add(self)  # a fork child makes it forget the parent's saves

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
        runtime().order.leave_saves_of(threading.current_thread())
        runtime().errors.raise_first()
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
        runtime().order.leave_saves_of(me)
        if not self._snapshots.wait_ended(timeout):
            raise TimeoutError(f"DataStatesWriter.close(): the saves staged into {self.path} did not end in {timeout} s")
        save = self._save
        if save is not None and save.target.thread is not me:
            if not runtime().order.wait_ended(lambda t: t is save.target.ticket, timeout):
                raise TimeoutError(f"DataStatesWriter.close(): the save into {save.target.path} did not end in {timeout} s")
        if save is not None and not save.ended:  # a save DCP failed between our calls
            self._clean_up(save)
        self._closed = True
        runtime().errors.raise_first(self._serial)

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
            check_save_target(checkpoint_id, self.compression, self.base)
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

    def _rule(self, save: RankSave) -> PlacementRule:
        """How this writer places a synchronous save's items: in files named by the save's id,
        with its compression and stripes. Into object storage one stripe unless asked: stripes
        parallelize a file system's writes, and each would be an upload of its own, with its
        parts in flight in memory; the store's upload has its own parallelism."""
        if self._stripes is not None:
            striping = (self._stripes, 0)
        elif not save.target.dest.is_file_system:
            striping = (1, 0)
        else:
            striping = (self._io_threads, AUTO_STRIPE_MIN_BYTES)
        return PlacementRule(save.target.save_id, descriptor_of(self.compression), striping)

    def _destination(self, path: str):
        """Where a save into ``path`` writes (a store is opened once per path and writer)."""
        dest = self._destinations.get(path)
        if dest is None:
            dest = self._destinations[path] = destination_of(path, self.store_options, self.verify_upload)
        return dest

    def storage_meta(self) -> StorageMeta | None:
        # DCP's first call of every save: the save begins here.
        target = self._begin_save().target
        return StorageMeta(checkpoint_id=target.path, save_id=target.dcp_save_id)

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
            save.gc_pause = CallPause.begin()  # DCP plans the save next (see native/gc_pause.py)
            save.target.dest.prepare()
            # Checked again here (stage() did too): an earlier save may have committed since.
            if not self.overwrite:
                save.target.dest.refuse_committed()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        save = self._current()
        if not plan.usable:  # DCP's plan cache: the plan is the one an earlier save wrote
            save.stats.plan_from_cache = True
            return plan
        with self._failing(save):
            plan = row_plan(plan)  # DCP gathers it: pickled as rows
            if not save.target.asynchronous:
                return plan
            # The snapshot placed the rank's tensors: the coordinator predicts the layout from them.
            staged = rank_file.staged_placement(save.target.snapshot, plan.items)
            return dataclasses.replace(plan, storage_data=staged)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save = self._current()
        with self._failing(save):
            if all(p.usable for p in plans):  # else DCP's plan cache stands in for some plans
                staged = [isinstance(p.storage_data, StagedRankData) for p in plans]
                if any(staged) and not all(staged):
                    raise CheckpointError("some ranks saved asynchronously and others not; every rank must use the same call")
                save.plans = tuple(plans)
            if not save.target.asynchronous:  # else each rank's snapshot placed its tensors
                rule = self._rule(save)
                plans = [dataclasses.replace(p, storage_data=rule) if p.usable else p for p in plans]
            return [row_plan(p) for p in plans]  # DCP scatters them: pickled as rows

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._current()
        target = save.target
        with self._failing(save), self._gc_paused(save):
            increment = placement = None
            if target.asynchronous:
                write = self._start_snapshot_write(save, plan, planner)
            else:
                write, increment, placement = self._start_planned_write(save, plan, planner)
            save.job = write.job
            if save.is_coordinator and increment is None:
                save_metadata.stage_predicted(save, planner, self._rule(save), placement, self.sequence)
            entries = write.complete(target.dest, save.stats, target.snapshot)
            report = write.report
            if increment is not None:
                entries += [item_entry(index, chunk.location()) for index, chunk in increment.references.items()]
                report = incremental.report_increments(report, increment.references.values(), increment.digests)
            save.stats.rank_files = RankFiles(save.rank, report.data_file, report.index_file, report.save_id, report.stripes)
            results = rank_results(report, entries)
        self.last_save_stats = save.stats
        log_rank_written(save.rank, target.path, save.stats)
        if not save.is_coordinator:
            self._end(save)  # the coordinator commits; nothing more happens on this rank
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        save = self._current()
        target = save.target
        t0 = time.perf_counter()
        with self._failing(save), self._gc_paused(save):
            items, reports = split_reports(results)
            prediction = save.prediction
            if prediction is not None and prediction.holds(items, reports):
                layout = prediction.layout
            else:
                layout = layout_from_reports(items, reports, target.save_id, metadata, target.dest.where(METADATA_FILE))
            staged = save.staged
            if staged is None or staged.metadata is not metadata or staged.layout is not layout:
                save_metadata.discard(save)
                save_metadata.stage(save, metadata, layout, self.sequence)
            replaced = target.dest.files_of_committed() if self.overwrite else []  # read now: another save may have committed
            target.dest.commit_metadata(save.staged.handle, self.overwrite)
            # Committed from here on: nothing below may remove this checkpoint's files.
            save.staged = None
            self._end(save)
        keep = set(layout_files(layout))
        target.dest.after_commit([f for f in replaced if f not in keep])
        save.stats.commit_s = time.perf_counter() - t0
        self.last_save_stats = save.stats
        _log.info("committed %s: %d rank file(s), commit %.3f s", target.path, len(layout.ranks), save.stats.commit_s)

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
            ticket = runtime().order.reserve()
        runtime().order.begin(ticket)  # every earlier save has ended: no collective overlaps
        if snap is None:
            try:
                runtime().errors.raise_first()  # a synchronous save is the next save call too
            except BaseException:
                runtime().order.end(ticket)
                raise
        previous = self._save
        if previous is not None and not previous.ended:  # DCP failed between our calls of that save
            self._clean_up(previous)
        stats = SaveStats(asynchronous=snap is not None, began_at=time.perf_counter())
        if snap is not None:
            stats.began_at = snap.captured_at
            stats.stage_call_s = snap.stage_call_s
            stats.staged_s = snap.staged_s
            path, dest = snap.directory, snap.dest
        else:
            try:
                if self.path is None:
                    raise ValueError("DataStatesWriter has no path: pass one or give dcp.save a checkpoint_id")
                path, dest = self.path, self._destination(self.path)
            except BaseException:
                runtime().order.end(ticket)
                raise
        target = SaveTarget(path, dest, new_save_id(), self.save_id, me, ticket, snap, self._serial)
        save = self._save = RankSave(target, stats)
        with self._failing(save):
            if snap is not None and given_path is not None and not snap.dest.same_place(given_path):
                raise ValueError(
                    f"this save was staged into {snap.directory} (the writer's path when dcp.async_save "
                    f"called stage()), but DCP was given checkpoint_id={given_path!r}; set the path on the "
                    "writer before dcp.async_save: DataStatesWriter(path) or writer.reset(path)"
                )
        return save

    def _current(self) -> RankSave:
        save = self._save
        if save is None or save.target.thread is not threading.current_thread() or save.ended:
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
                if save.target.asynchronous:
                    runtime().errors.record(save.target.writer_serial, save.target.path, exc)
            raise

    @staticmethod
    def _gc_paused(save: RankSave):
        """Pause the cyclic GC (tens of thousands of small objects, no cycles) only in the caller's
        main thread (gc_pause.main_thread_gc_paused), never for a save beside the training loop
        (DCP's asynchronous save), or it would be off for the loop meanwhile."""
        if save.target.asynchronous or _dcp_compat.runs_one_save(save.target.thread):
            return contextlib.nullcontext()
        return main_thread_gc_paused()

    def _end(self, save: RankSave) -> None:
        """The writer's part of the save is over (committed, or this rank's data written)."""
        save.ended = True
        save.job = None
        if save.gc_pause is not None:
            save.gc_pause.end()
        if save.target.snapshot is not None:
            save.target.snapshot.end()
        runtime().order.end_unless_bound(save.target.ticket)

    def _clean_up(self, save: RankSave) -> None:
        """Remove the files of a save that will not commit."""
        dest, snap = save.target.dest, save.target.snapshot
        committed = dest.committed_by(save.staged.handle if save.staged is not None else None)
        if committed:
            self._end(save)  # interrupted right after the rename (KeyboardInterrupt): committed, keep it
            return
        # Not committed, or (None) a store that cannot tell: then nothing is removed, since a
        # .metadata that landed would name these files (strays at worst).
        if snap is not None:
            snap.cancel("save failed", remove=committed is False)
        _native.stop_write_job(save.job, "save failed")
        self._end(save)
        if committed is False:
            dest.remove(save.written_files)
        save_metadata.discard(save)

    # -- placement and metadata -----------------------------------------------------

    def _start_planned_write(self, save: RankSave, plan: SavePlan, planner: SavePlanner):
        """Place this rank's items of a synchronous plan (less those an incremental save refers to)
        and start writing them: ``(RankWrite, increment or None, placement)``."""
        own = self._rule(save)
        rule = rule_to_place(plan.storage_data, own)
        if rule is own:  # an earlier save's plan from DCP's cache: placed again in files of this save
            save.stats.plan_from_cache = True
        increment = self._increment(save, plan, planner)
        if increment is not None:
            plan = incremental.without_references(plan, increment)
        placement = place_rank(plan.items, save.rank, rule)
        save.written_files = placement.file_names()
        write = rank_file.start_planned(save.target.dest, plan, planner, placement, self._settings(), save.stats)
        return write, increment, placement

    def _start_snapshot_write(self, save: RankSave, plan: SavePlan, planner: SavePlanner) -> rank_file.RankWrite:
        """Finish writing this rank's snapshot, by the placement it sent with its local plan."""
        snap = save.target.snapshot
        staged = plan.storage_data
        if not isinstance(staged, StagedRankData) or staged.save_id != snap.save_id:
            # DCP's plan cache: an earlier save's final plan; map its items to this snapshot
            save.stats.plan_from_cache = True
            staged = rank_file.staged_placement(snap, plan.items)
        return rank_file.start_snapshot(snap, staged, plan, planner, self._settings(), save.stats)

    def _increment(self, save: RankSave, plan: SavePlan, planner: SavePlanner) -> incremental.RankIncrement | None:
        """This rank's incremental decisions for a synchronous plan (None: a full save without
        digests). Hashes the large chunks the base may hold, and those whose digests are recorded."""
        if not self.record_digests or getattr(planner, "resolve_creates_tensors", False):
            return None
        base = None
        if self.base is not None:
            base = incremental.BaseCheckpoint(self.base)
            base.check_sibling_of(save.target.path)
        increment = incremental.decide(plan, planner.resolve_data, base, self.change_tracker, self._io_threads)
        stats = save.stats
        stats.hashed_bytes, stats.referenced_bytes, stats.hash_s = (
            increment.hashed_bytes, increment.referenced_bytes, increment.hash_s,
        )
        return increment

    def _forget_parent_saves(self) -> None:
        """In a fork child: the saves this writer staged or ran in the parent go on
        (and are cleaned up) in the parent only; here the writer starts idle."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._snapshots = WriterSnapshots()
        self._reset_paths = {}
        self._save = None


_log = logging.getLogger(__name__)


def _new_dcp_id() -> str:
    """A save or load id the way DCP's FileSystemWriter/Reader make them (a uuid4 string)."""
    return str(uuid.uuid4())


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
