"""DataStatesWriter: the StorageWriter (and AsyncStager) of dcp_datastates.

Synchronous saves (``dcp.save``), per rank:
1. ``prepare_global_plan`` (coordinator) fixes each rank's files and offsets
   (unless DataStatesSavePlanner already did) after DCP deduplicated items;
2. ``write_data`` hands every tensor to the engine as a region at its planned
   offset and returns to Python at once; while the engine copies, checksums
   and writes, Python serializes the objects (appended after the tensors)
   and, on the coordinator, pickles the final metadata to a temporary file;
   the rank then waits for the engine (one fsync of the data file) and
   writes its index (checksums, object table);
3. ``finish`` (coordinator) only commits: directory fsync, rename of the
   temporary metadata to ``.metadata``, directory fsync.

Asynchronous saves (``dcp.async_save``) start earlier: ``stage()`` captures a
lazy snapshot (see :mod:`snapshot`) that places the rank's tensors in its own
file and streams them through the engine's bounded pool while training goes
on, and returns a future that completes once every byte has left the
caller's tensors. DCP then runs steps 1-3 in a background thread; the plan
only maps items to bytes the snapshot already placed. Saves run one after
another in the order they were staged (:mod:`sequencer`); an error of a
background save fails its future and is raised again by the next save call.

Saving into a directory that holds a committed checkpoint is refused unless
``overwrite=True``; an overwrite writes new files beside the old ones and
removes the old checkpoint's files only after the new ``.metadata`` is in place.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import os
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_datastates.native import engine as _native
from dcp_datastates.core import fence
from dcp_datastates.core import snapshot as snapshots
from dcp_datastates.core.commit import fsync_dir, remove_if_present, rename_into_place, rename_without_replacing, write_new_file_durably
from dcp_datastates.errors import CheckpointError, CheckpointExistsError
from dcp_datastates.format.rank_index import METADATA_FILE, CheckpointLayout, ItemLocation, encode_index, location_key, metadata_tmp_name
from dcp_datastates.format.metadata_file import encode_metadata, read_metadata_file
from dcp_datastates.core.layout import (
    PAGE,
    SMALL_ALIGN,
    RankPlanData,
    StagedRankData,
    align_up,
    assign_checkpoint_layout,
    assign_staged_layout,
    has_layout,
    has_staged_layout,
    new_save_id,
    plan_rank_layout,
    staged_locations,
    tensor_item_nbytes,
)
from dcp_datastates.core.providers import check_planned, finish_regions, provide_object, tensor_source
from dcp_datastates.core import plan_cache
from dcp_datastates.core.sequencer import SEQUENCER
from dcp_datastates.core.snapshot import Snapshot
from dcp_datastates.core.compression import descriptor_of, resolve_compression

try:  # DCP's own version tag for the metadata it writes
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # pragma: no cover
    CURRENT_DCP_VERSION = None


@dataclasses.dataclass
class SaveStats:
    """Timings of the last save on this rank (seconds), for benchmarks and logs."""

    bytes_written: int = 0
    items: int = 0
    direct_io: bool = False
    asynchronous: bool = False
    stage_call_s: float = 0.0  # async: time the caller spent in stage()
    staged_s: float = 0.0  # async: from stage() until every byte left the caller's tensors
    submit_s: float = 0.0  # resolving items and handing regions to the engine
    objects_s: float = 0.0  # serializing Python objects (overlaps the engine)
    metadata_serialize_s: float = 0.0  # coordinator: pickling + writing the metadata (overlaps)
    metadata_done_before_data: bool = False  # the engine was still writing when metadata was done
    data_write_s: float = 0.0  # sync: from handing regions to the engine until data fsynced
    index_s: float = 0.0
    commit_s: float = 0.0  # coordinator: finish()
    plan_from_cache: bool = False  # DCP's plan cache (enable_plan_caching) supplied this rank's plan


@dataclasses.dataclass
class _Save:
    """One save on this rank, from DCP's first call (``storage_meta``) to its end."""

    path: str
    save_id: str
    thread: threading.Thread
    snapshot: Snapshot | None  # asynchronous saves: the staged snapshot
    stats: SaveStats
    writer_id: int = 0
    is_coordinator: bool = False
    rank: int = 0
    layout: CheckpointLayout | None = None  # set when the writer (not the planner) placed items
    # Coordinator, sync saves: rank -> (RankLayout, plan item indices), reused by its own
    # write_data and by the check of every rank's results.
    rank_layouts: dict = dataclasses.field(default_factory=dict)
    tensor_locations: dict | None = None  # async: location_key -> (offset, nbytes)
    metadata_tmp: str | None = None
    metadata_obj: Metadata | None = None
    replaced_files: list[str] = dataclasses.field(default_factory=list)
    written_files: list[str] = dataclasses.field(default_factory=list)  # sync: this rank's files
    job: Any = None  # sync: the engine job writing this rank's data file
    ticket: int = -1  # its place in the process-wide order of saves (sequencer)
    dcp_save_id: str | None = None  # writer.save_id when the save began (StorageMeta.save_id)
    plan_cached: bool = False  # coordinator: some plans came from DCP's cache; layout from results
    report: Any = None  # the files this rank wrote (plan_cache.RankReport)
    ended: bool = False


@dataclasses.dataclass
class _RankFile:
    """A rank's data file whose tensors are placed (and being written): what finishing it needs."""

    job: Any  # the engine's WriteJob, not sealed yet
    rank: int
    save_id: str  # the id in the file names and the index
    data_file: str
    index_path: str
    objects_base: int
    tensor_end: int
    tensor_spans: Callable[[], list]  # (offset, end, fqn) of every tensor, built only for an error message
    blocks: list = dataclasses.field(default_factory=list)  # (offset, length, fqn) of compressed frames


# The largest batch a ``resolve_creates_tensors`` planner's tensors are resolved in.
_BATCH_BYTES_MAX = 256 << 20

# Held while a staged snapshot takes its ticket and joins the staging monitor's queue.
_STAGE_ORDER = threading.Lock()

# Errors of background saves not yet raised to the caller: (writer id, path, error).
_unreported_lock = threading.Lock()
_unreported: list[tuple[int, str, BaseException]] = []


def _record_background_error(writer_id: int, path: str, exc: BaseException) -> None:
    with _unreported_lock:
        _unreported.append((writer_id, path, exc))


def _raise_unreported(writer_id: int | None = None) -> None:
    """Raise (once) the first error of an earlier background save; ``writer_id`` filters."""
    with _unreported_lock:
        mine = [e for e in _unreported if writer_id is None or e[0] == writer_id]
        for e in mine:
            _unreported.remove(e)
    if mine:
        _, path, exc = mine[0]
        more = f" ({len(mine) - 1} more failed too)" if len(mine) > 1 else ""
        raise CheckpointError(f"an earlier asynchronous save to {path} failed{more}: {exc}") from exc


# Writers alive in this process, so that a fork child can reset what they inherited.
_live_writers: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A fork child starts with no save in flight: the parent's saves, their errors
    and the locks their threads may have held at the fork stay with the parent."""
    global _STAGE_ORDER, _unreported_lock
    _STAGE_ORDER = threading.Lock()
    _unreported_lock = threading.Lock()
    _unreported.clear()
    for writer in list(_live_writers):
        writer._forget_parent_saves()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DataStatesWriter(StorageWriter, AsyncStager):
    """Write DCP checkpoints as coalesced per-rank files through the native engine.

    Works with ``dcp.save`` and, as an ``AsyncStager``, with ``dcp.async_save``,
    whose ``stage()`` returns at once while the engine copies the state through
    ``host_cache_bytes`` of reused host memory.

    Args:
        path: checkpoint directory. ``dcp.async_save`` stages before it passes
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
        _extensions: DCP's ``FileSystemWriter`` argument, accepted so that
            switching is one argument: ``[ZStandard()]`` means ``compression="zstd"``;
            any other extension is refused.

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
        _extensions: Sequence[Any] | None = None,
    ) -> None:
        super().__init__()
        if direct_io not in _native.DIRECT_IO_MODES:
            raise ValueError(f"direct_io must be one of {_native.DIRECT_IO_MODES}, got {direct_io!r}")
        self.compression = resolve_compression(compression, compression_level, _extensions)
        self.path = os.fspath(path) if path is not None else None
        self.overwrite = overwrite
        self.direct_io = direct_io
        if not isinstance(sequence, int) or isinstance(sequence, bool) or not 0 <= sequence < 1 << 64:
            raise ValueError(f"sequence must be an integer in [0, 2**64), got {sequence!r}")
        self.sequence = sequence
        # The engine belongs to a process: see the _engine property (forks).
        self._engine_ref = _native.ProcessEngine(host_cache_bytes, io_threads, window_bytes)
        self.is_coordinator = False
        self.last_save_stats = SaveStats()
        self._lock = threading.Lock()
        self._pending: collections.deque[Snapshot] = collections.deque()  # staged, save not begun
        self._staged: list[Snapshot] = []  # every snapshot not yet known to have ended
        self._reset_paths: dict[int, str] = {}  # thread ident -> path DCP gave reset()
        self._save: _Save | None = None  # the save in progress (or the last one)
        self._closed = False
        # DCP's id of the save (StorageMeta.save_id), as FileSystemWriter keeps it: made here and
        # by every reset(). Files are named by a separate id, new for every save.
        self.save_id = _new_dcp_id()
        _live_writers.add(self)

    @property
    def _engine(self) -> _native._engine.Engine:
        """This process's engine for the writer's settings.

        A writer made before a fork gets the child's own engine there: the
        parent's has no threads in the child and would never finish a job.
        """
        return self._engine_ref.get()

    def _forget_parent_saves(self) -> None:
        """In a fork child: the saves this writer staged or ran in the parent go on
        (and are cleaned up) in the parent only; here the writer starts idle."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._pending = collections.deque()
        self._staged = []
        self._reset_paths = {}
        self._save = None

    # -- AsyncStager protocol ---------------------------------------------------

    def stage(self, state_dict: Any) -> snapshots.StagingFuture:
        """Start a lazy snapshot of ``state_dict`` and return at once.

        The returned future completes when every byte has left the caller's
        tensors (it is in the host pool or on disk); DCP's ``async_save`` turns
        it into ``AsyncSaveResponse.staging_completion``. Raises the error of
        an earlier background save that failed, if any, first.
        """
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("DataStatesWriter is closed")
        _raise_unreported()
        if self.path is None:
            raise ValueError(
                "DataStatesWriter needs its path before dcp.async_save stages the state: pass it to "
                "DataStatesWriter(path) (writers are cheap: they share the process-wide engine), or "
                "call writer.reset(path) before dcp.async_save"
            )
        if not self.overwrite:
            _refuse_committed(self.path)
        os.makedirs(self.path, exist_ok=True)
        snap = Snapshot(self.path, _global_rank(), self.compression)
        try:
            with _native.gc_paused():
                snap.capture(state_dict, self._engine, self.direct_io)
        except BaseException:
            snap.cancel("snapshot capture failed")
            raise
        # The ticket and the monitor's queue must have the same order: the monitor
        # resolves snapshots in queue order, each after every earlier ticket began.
        with _STAGE_ORDER:
            snap.ticket = SEQUENCER.reserve()
            with self._lock:
                self._pending.append(snap)
                self._staged = [s for s in self._staged if not (s.ended or s.abandoned)]
                self._staged.append(snap)
            fence.track(snap.future)
            snapshots.submit(snap)
        snap.stage_call_s = time.perf_counter() - t0
        return snap.future

    def synchronize_staging(self) -> None:
        """Wait until every snapshot staged so far has left the caller's tensors."""
        import concurrent.futures

        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait([snap.future for snap in pending])

    def close(self, timeout: float | None = None) -> None:
        """Wait for every save this writer staged to end, then raise any error they hit.

        A staged snapshot ends when DCP's background save of it has returned.
        ``timeout`` bounds the wait (``TimeoutError`` after it).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            staged, self._staged = self._staged, []
        for snap in staged:
            while snap.thread is None and not snap.abandoned:  # DCP's save has not begun yet
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"DataStatesWriter.close(): a save staged into {snap.directory} never began")
                time.sleep(0.002)
            SEQUENCER.wait_idle(snap.thread, snap.ticket)
        save = self._save
        if save is not None:
            SEQUENCER.wait_idle(save.thread, save.ticket)
            self._abandon_unfinished(save)
        self._closed = True
        _raise_unreported(id(self))

    def __enter__(self) -> DataStatesWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - the exception already propagating wins
                pass

    def __getstate__(self):
        # DCP's process-based executor pickles the writer into another process,
        # which has neither the snapshot nor the engine that holds its bytes.
        me = threading.get_ident()
        with self._lock:
            snap = next((s for s in self._pending if s.future.consumer == me), None)
            if snap is not None:
                self._pending.remove(snap)
        if snap is not None:
            snap.cancel("the writer was sent to another process")
            SEQUENCER.abandon(snap.ticket)
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
            self.path = os.fspath(checkpoint_id)
            with self._lock:
                self._reset_paths[threading.get_ident()] = self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            path = os.fspath(checkpoint_id)
        except TypeError:
            return False
        return isinstance(path, str) and "://" not in path

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
            os.makedirs(save.path, exist_ok=True)
            # Checked again here (stage() did too): an earlier save may have committed since.
            if not self.overwrite:
                _refuse_committed(save.path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        save = self._current()
        if not plan.usable:  # DCP's plan cache: the plan is the one an earlier save wrote
            save.stats.plan_from_cache = True
            return plan
        if save.snapshot is None:
            return plan
        with self._failing(save), _native.gc_paused():
            snap = save.snapshot
            save.tensor_locations = _snapshot_locations(snap, plan)
            staged = StagedRankData(
                save.rank, snap.save_id, snap.data_file, snap.index_file, snap.tensor_bytes_end, save.tensor_locations,
                descriptor_of(snap.compression),
            )
            return dataclasses.replace(plan, storage_data=staged)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save = self._current()
        with self._failing(save), _native.gc_paused():
            if any(not p.usable for p in plans):
                return self._prepare_cached_global_plan(save, plans)
            save.rank_layouts = {}
            if has_staged_layout(plans):  # asynchronous: every rank already placed its tensors
                save.layout = assign_staged_layout(plans, save.save_id)
                return plans
            if any(isinstance(p.storage_data, StagedRankData) for p in plans):
                raise CheckpointError("some ranks saved asynchronously and others not; every rank must use the same call")
            compression = descriptor_of(self.compression)
            if has_layout(plans) and compression is None:  # DataStatesSavePlanner placed everything
                save.layout = None
                return plans
            # (With compression, a planner's raw layout is replaced by one with compressed chunks.)
            plans, save.layout, layouts = assign_checkpoint_layout(plans, save.save_id, compression)
            save.rank_layouts = {lay.rank: (lay, [item.index for item in p.items]) for lay, p in zip(layouts, plans)}
            return plans

    def _prepare_cached_global_plan(self, save: _Save, plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's save-plan caching: unusable plans stand for plans cached by an earlier save.

        Those ranks write the cached final plan again, in files of their own
        (see :mod:`plan_cache`); changed synchronous plans get a layout as
        usual. The checkpoint's layout is built from the write results in
        ``finish``.
        """
        save.plan_cached = True
        save.layout = None
        save.rank_layouts = {}
        if save.snapshot is not None:  # each rank's snapshot placed its tensors
            return plans
        compression = descriptor_of(self.compression)
        sent = [p if p.usable else SavePlan([]) for p in plans]
        placed, _, _ = assign_checkpoint_layout(sent, save.save_id, compression)
        return [new if old.usable else old for old, new in zip(plans, placed)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._current()
        with self._failing(save), _native.gc_paused():
            if save.snapshot is not None:
                snap = save.snapshot
                staged = plan.storage_data
                if not (isinstance(staged, StagedRankData) and staged.save_id == snap.save_id):
                    # DCP's plan cache: an earlier save's final plan; map its items to this snapshot
                    save.stats.plan_from_cache = True
                    save.tensor_locations = _snapshot_locations(snap, plan)
                results = self._write_staged(save, plan, planner)
                save.report = plan_cache.RankReport(
                    snap.data_file, snap.index_file, snap.save_id,
                    descriptor_of(snap.compression),
                )
            else:
                results = self._write_now(save, plan, planner)
            results.append(plan_cache.report_result(save.report))
        self.last_save_stats = save.stats
        if not save.is_coordinator:
            _end(save)  # the coordinator commits; nothing more happens on this rank
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        save = self._current()
        t0 = time.perf_counter()
        with self._failing(save), _native.gc_paused():
            results, reports = plan_cache.split_reports(results)
            layout = save.layout or metadata.storage_data
            if save.plan_cached or (isinstance(layout, CheckpointLayout) and not plan_cache.reports_match(layout, reports)):
                # Plans from DCP's cache named an earlier save's files: what the ranks wrote decides.
                where = os.path.join(save.path, METADATA_FILE)
                layout = save.layout = plan_cache.layout_from_results(results, reports, save.save_id, metadata, where)
                save.rank_layouts = {}
                self._discard_metadata_tmp(save)
            if not isinstance(layout, CheckpointLayout):
                raise CheckpointError("finish() called without a dcp_datastates layout (prepare_global_plan skipped?)")
            for rank, rank_results in enumerate(results):
                planned = save.rank_layouts[rank][0].locations if rank in save.rank_layouts else None
                for wr in rank_results:
                    loc = planned.get(wr.index) if planned is not None else layout.location(wr.index)
                    if loc != wr.storage_data:
                        raise CheckpointError(
                            f"write result for {wr.index.fqn!r} does not match its planned location"
                        )
            if metadata is not save.metadata_obj or save.metadata_tmp is None:
                # The planner did not expose its metadata early: serialize now.
                self._discard_metadata_tmp(save)
                self._write_metadata_tmp(save, metadata, layout)
            if self.overwrite:  # read now: another save may have committed since this one began
                save.replaced_files = _files_of_committed(save.path)
            _commit_metadata(save, self.overwrite)
            # Committed from here on: nothing below may remove this checkpoint's files.
            save.metadata_tmp = None
            save.metadata_obj = None
            _end(save)
        keep = {name for r in layout.ranks for name in (r.data_file, r.index_file)}
        stale = [os.path.join(save.path, f) for f in save.replaced_files if f not in keep]
        try:
            fsync_dir(save.path)  # the rename is durable
            if stale:
                remove_if_present(stale)
                fsync_dir(save.path)
        except OSError as exc:
            raise CheckpointError(
                f"{save.path} is committed (.metadata is in place), but making that durable failed: "
                f"{exc}; it may not survive a power loss, and files of the checkpoint it replaced may remain"
            ) from exc
        save.stats.commit_s = time.perf_counter() - t0
        self.last_save_stats = save.stats

    # -- the two ways of writing a rank's data ------------------------------------

    def _write_now(self, save: _Save, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Synchronous save: place, copy and write the plan's items now."""
        info = plan.storage_data
        if plan_cache.is_stale(info):
            info = self._replace_cached_plan_data(save, plan, info)
        if not isinstance(info, RankPlanData):
            raise CheckpointError("save plan carries no dcp_datastates layout; was prepare_global_plan skipped?")
        plan_cache.mark_written(plan.storage_data)
        cached = save.rank_layouts.get(info.rank)
        if cached is not None and cached[0].save_id == info.save_id and cached[1] == [i.index for i in plan.items]:
            layout = cached[0]
        else:
            layout = plan_rank_layout(plan.items, info.rank, info.save_id, getattr(info, "compression", None))
        if layout.tensor_bytes_end != info.tensor_bytes_end or len(layout.locations) != info.item_count:
            raise CheckpointError(
                f"rank {info.rank}: local layout disagrees with the coordinator's "
                "(the planner reordered items after global planning)"
            )
        stats = save.stats
        stats.items = len(plan.items)
        data_path = os.path.join(save.path, layout.data_file)
        index_path = os.path.join(save.path, layout.index_file)
        save.written_files = [data_path, index_path]
        save.report = plan_cache.RankReport(layout.data_file, layout.index_file, info.save_id, layout.compression)
        t0 = time.perf_counter()
        if getattr(planner, "resolve_creates_tensors", False):
            job, results = self._submit_in_batches(save, plan, planner, layout, data_path)
        else:
            placed, results = [], []
            for item in plan.items:
                loc = layout.locations[item.index]
                if loc.object_ordinal >= 0:  # objects, and compressed chunks (below)
                    continue
                source = tensor_source(planner.resolve_data(item), item.index.fqn)
                check_planned(item, source, loc.length)
                placed.append((source, loc.offset))
                results.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
            regions, keep = finish_regions(placed)
            del placed
            job = self._engine.write(
                data_path, regions, keep, direct_io=self.direct_io, preallocate=layout.tensor_bytes_end
            )
            save.job = job
            del keep
        blocks, objects_base = [], layout.objects_base
        if layout.compression is not None:
            blocks, objects_base = self._write_compressed(plan, planner, layout, job, results)
        save.stats.submit_s = time.perf_counter() - t0
        rank_file = _RankFile(
            job, info.rank, info.save_id, layout.data_file, index_path, objects_base, layout.tensor_bytes_end,
            lambda: [(loc.offset, loc.offset + loc.length, idx.fqn) for idx, loc in layout.locations.items() if loc.object_ordinal < 0],
            blocks,
        )
        self._finish_rank_file(save, plan, planner, rank_file, results, t0)
        return results

    def _replace_cached_plan_data(self, save: _Save, plan: SavePlan, stale) -> RankPlanData:
        """Storage data for a final plan DCP's cache returned (it names an earlier save):
        the same items placed again, in files named by this rank's own new save id."""
        save.stats.plan_from_cache = True
        # This writer's own setting: DCP's cache is per planner class and process, so the
        # cached plan may come from another writer (another compression, or FileSystemWriter).
        compression = descriptor_of(self.compression)
        rank = getattr(stale, "rank", None)
        if not isinstance(rank, int):
            rank = save.rank
        layout = plan_rank_layout(plan.items, rank, save.save_id, compression)
        # The cached placement can be checked only when it was made with the same settings
        # (compressed chunks leave the raw tensor area, so its end moves).
        if (
            isinstance(stale, RankPlanData)
            and getattr(stale, "compression", None) == compression
            and (layout.tensor_bytes_end != stale.tensor_bytes_end or len(layout.locations) != stale.item_count)
        ):
            raise CheckpointError(f"rank {rank}: the cached plan no longer matches its own layout")
        save.rank_layouts[rank] = (layout, [item.index for item in plan.items])
        return layout.plan_data()

    def _compression_for(self, descriptor: tuple):
        """This writer's settings for the codec the coordinator chose (its level; defaults else)."""
        from dcp_datastates.core.compression import Compression

        mine = self.compression
        if mine is not None and mine.descriptor == tuple(descriptor):
            return mine
        return Compression(codec=descriptor[0], block_bytes=descriptor[1])

    def _write_compressed(self, plan: SavePlan, planner: SavePlanner, layout, job, results: list):
        """Compress the plan's compressed chunks into frames appended to ``job`` after the raw tensors.

        Returns ``(frames, end)``: ``(offset, length, fqn)`` per frame in ordinal
        order, and the aligned offset where the objects go.
        """
        from dcp_datastates.core.compression import BlockAppender, submit_tensor

        n_objects = sum(1 for item in plan.items if item.type == WriteItemType.BYTE_IO)
        appender = BlockAppender(
            job, self._compression_for(layout.compression), layout.objects_base, n_objects,
            _native.ALIGNMENT, self._engine.window_bytes,
        )
        try:
            for item in plan.items:
                loc = layout.locations[item.index]
                if not loc.is_compressed:
                    continue
                appender.check_ordinal(item.index.fqn, loc.object_ordinal)
                source = tensor_source(planner.resolve_data(item), item.index.fqn)
                check_planned(item, source, loc.length)
                results.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
                submit_tensor(appender, item.index.fqn, source.tensor, loc.length)
                del source
            return appender.finish()
        except BaseException:
            appender.abandon()
            raise

    def _submit_in_batches(self, save: _Save, plan: SavePlan, planner: SavePlanner, layout, data_path: str):
        """Resolve, submit and release the tensors a batch at a time (``resolve_creates_tensors``).

        The normal path resolves every item before submitting, which is free
        when ``resolve_data`` returns the caller's own tensors but would hold a
        whole checkpoint when each call materialises a new tensor (the
        converter reads each one from another checkpoint). Here a batch of at
        most the pool's bytes (at least one item) is submitted, and once the
        engine has staged it (copied it into the pool: it never reads those
        buffers again) the job and this function drop their references before
        the next batch is resolved. Batches split only at offsets the engine
        accepts for an append (at or after the previous batch's aligned end),
        so small tensors packed into one page stay in one batch.
        """
        limit = min(self._engine.pool_bytes, _BATCH_BYTES_MAX)
        tensor_items = [item for item in plan.items if layout.locations[item.index].object_ordinal < 0]  # raw chunks
        tensor_items.sort(key=lambda item: layout.locations[item.index].offset)
        job, results, batch, batch_bytes, batch_end = None, [], [], 0, 0

        def submit() -> bool:
            nonlocal job, batch_bytes
            regions, keep = finish_regions(batch)
            batch.clear()
            batch_bytes = 0
            if job is None:
                job = self._engine.write(
                    data_path, regions, keep, direct_io=self.direct_io, preallocate=layout.tensor_bytes_end
                )
                save.job = job
            else:
                job.append(regions, keep)
            del keep, regions
            return job.release_staged()  # False: the job failed; job.wait() raises its error

        for item in tensor_items:
            loc = layout.locations[item.index]
            splittable = loc.offset >= align_up(batch_end, _native.ALIGNMENT)
            if batch and splittable and batch_bytes + loc.length > limit:
                if not submit():
                    break
            source = tensor_source(planner.resolve_data(item), item.index.fqn)
            check_planned(item, source, loc.length)
            batch.append((source, loc.offset))
            del source
            batch_bytes += loc.length
            batch_end = loc.offset + loc.length
            results.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
        else:
            if batch or job is None:
                submit()
        batch.clear()
        return job, results

    def _write_staged(self, save: _Save, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Asynchronous save: the snapshot already placed and is writing the tensors."""
        snap = save.snapshot
        assert snap is not None and save.tensor_locations is not None
        stats = save.stats
        stats.items = len(plan.items)
        t0 = time.perf_counter()
        if snap.compression is not None:
            return self._write_staged_compressed(save, plan, planner, t0)
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            placed = save.tensor_locations.get(location_key(item.index.fqn, item.index.offset))
            if placed is None:
                raise CheckpointError(f"{item.index.fqn!r} is in the final plan but was not in the local plan")
            loc = ItemLocation(snap.data_file, placed[0], placed[1], -1)
            results.append(WriteResult(index=item.index, size_in_bytes=placed[1], storage_data=loc))
        locations = save.tensor_locations
        rank_file = _RankFile(
            snap.job, save.rank, snap.save_id, snap.data_file, snap.index_path, snap.objects_base, snap.tensor_bytes_end,
            lambda: [(off, off + n, fqn) for (fqn, _), (off, n) in locations.items()],
        )
        self._finish_rank_file(save, plan, planner, rank_file, results, t0)
        return results

    def _write_staged_compressed(self, save: _Save, plan: SavePlan, planner: SavePlanner, t0: float) -> list[WriteResult]:
        """Asynchronous compressed save: compress the snapshot's staging file into the data file.

        The snapshot staged raw bytes (bounded by the host cache) into its staging
        file; here, in DCP's background thread, its small tensors are copied as
        they are, its large ones compressed block by block (read back with their
        checksums verified), and the staging file is removed once the data file
        and its index are durable.
        """
        from dcp_datastates.core.compression import compress_staged

        snap = save.snapshot
        descriptor = snap.compression.descriptor
        finals = staged_locations(plan.items, save.tensor_locations, descriptor, save.rank)
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            offset, length, ordinal = finals[location_key(item.index.fqn, item.index.offset)]
            loc = ItemLocation(snap.data_file, offset, length, ordinal)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=loc))
        snap.job.seal()
        try:
            staged_segments = snap.job.wait()  # the staging file is complete (and the snapshot's memory free)
        except OSError as exc:
            locations = save.tensor_locations
            raise _with_key_context(exc, [(off, off + n, fqn) for (fqn, _), (off, n) in locations.items()]) from exc
        if snap.staging_error is not None:
            raise snap.staging_error
        n_objects = sum(1 for item in plan.items if item.type == WriteItemType.BYTE_IO)
        job, small_end, blocks, end = compress_staged(
            self._engine, snap, staged_segments, plan, finals, n_objects, self.direct_io, save
        )
        rank_file = _RankFile(
            job, save.rank, snap.save_id, snap.data_file, snap.index_path, end, small_end,
            lambda: [(off, off + n, fqn) for (fqn, _), (off, n, o) in finals.items() if o < 0 and n >= 0],
            blocks,
        )
        self._finish_rank_file(save, plan, planner, rank_file, results, t0)
        remove_if_present([snap.staging_path])
        return results

    def _finish_rank_file(
        self, save: _Save, plan: SavePlan, planner: SavePlanner, rank_file: _RankFile, results: list, t0: float
    ) -> None:
        """Append the objects, overlap the metadata, wait for the data, write the index."""
        stats = save.stats
        job = rank_file.job
        t1 = time.perf_counter()
        objects, object_table, object_keys = [], [], []
        offset = rank_file.objects_base
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                continue
            blob = provide_object(item, planner.resolve_data(item))
            offset = align_up(offset, SMALL_ALIGN)
            results.append(
                WriteResult(
                    index=item.index, size_in_bytes=len(blob),
                    storage_data=ItemLocation(rank_file.data_file, -1, -1, len(object_table)),
                )
            )
            object_table.append((offset, len(blob)))
            object_keys.append(item.index.fqn)
            objects.append(blob)
            offset += len(blob)
        if objects:
            job.append([(_native.bytes_address(b), len(b), o) for b, (o, _) in zip(objects, object_table) if len(b)], objects)
        job.seal()
        t2 = time.perf_counter()
        stats.objects_s = t2 - t1
        if save.is_coordinator:
            self._serialize_metadata_early(save, planner)
            stats.metadata_done_before_data = stats.metadata_serialize_s > 0 and not job.done
        if save.snapshot is not None and save.snapshot.staging_error is not None:
            raise save.snapshot.staging_error
        try:
            segments = job.wait()
        except OSError as exc:
            spans = rank_file.tensor_spans() + [(o, o + n, k) for (o, n), k in zip(object_table, object_keys)]
            spans += [(o, o + n, k) for o, n, k in rank_file.blocks]
            raise _with_key_context(exc, spans) from exc
        t3 = time.perf_counter()
        stats.data_write_s = t3 - t0
        stats.direct_io = job.direct
        tensor_end = rank_file.tensor_end
        data_size = align_up(max(offset, tensor_end), PAGE) if (tensor_end or objects or rank_file.blocks) else 0
        object_table += [(o, n) for o, n, _ in rank_file.blocks]  # compressed frames: ordinals after the objects'
        write_new_file_durably(
            rank_file.index_path, encode_index(rank_file.rank, rank_file.save_id, data_size, segments, object_table)
        )
        stats.index_s = time.perf_counter() - t3
        stats.bytes_written = data_size

    # -- save lifecycle ---------------------------------------------------------

    def _begin_save(self) -> _Save:
        me = threading.current_thread()
        with self._lock:
            self._pending = collections.deque(s for s in self._pending if not s.abandoned)
            snap = next((s for s in self._pending if s.future.consumer == me.ident), None)
            if snap is None:  # an executor that consumed the future elsewhere: oldest staged first
                snap = next((s for s in self._pending if s.future.done() and s.future.consumer is None), None)
            if snap is not None:
                self._pending.remove(snap)
                snap.thread = me
            given_path = self._reset_paths.pop(me.ident, None)
        ticket = snap.ticket if snap is not None else SEQUENCER.reserve()
        SEQUENCER.begin(ticket)  # earlier saves have left DCP's save: no collective overlaps
        if snap is None:
            if self._closed:
                raise RuntimeError("DataStatesWriter is closed")
            _raise_unreported()  # a synchronous save is the next save call too
        if self._save is not None:
            self._abandon_unfinished(self._save)
        stats = SaveStats(asynchronous=snap is not None)
        path = snap.directory if snap is not None else self.path
        save = _Save(
            path=path, save_id=new_save_id(), thread=me, snapshot=snap, stats=stats, writer_id=id(self), ticket=ticket
        )
        self._save = save
        if snap is not None:
            stats.stage_call_s = snap.stage_call_s
            stats.staged_s = snap.staged_s
        with self._failing(save):
            if path is None:
                raise ValueError("DataStatesWriter has no path: pass one or give dcp.save a checkpoint_id")
            if snap is not None and given_path is not None and os.path.abspath(given_path) != os.path.abspath(snap.directory):
                raise ValueError(
                    f"this save was staged into {snap.directory} (the writer's path when dcp.async_save "
                    f"called stage()), but DCP was given checkpoint_id={given_path!r}; set the path on the "
                    "writer before dcp.async_save: DataStatesWriter(path) or writer.reset(path)"
                )
        return save

    def _current(self) -> _Save:
        save = self._save
        if save is None or save.thread is not threading.current_thread() or save.ended:
            raise CheckpointError(
                "DataStatesWriter was called outside a save (DCP calls storage_meta() first); "
                "one writer serves one save at a time"
            )
        return save

    class _failing:
        """On any error inside a writer call: clean up this save, remember the error."""

        def __init__(self, save: _Save) -> None:
            self.save = save

        def __enter__(self):
            return self

        def __exit__(self, exc_type, exc, tb):
            if exc_type is not None and not self.save.ended:
                _clean_up(self.save)
                if self.save.snapshot is not None:
                    _record_background_error(self.save.writer_id, self.save.path, exc)
            return False

    def _abandon_unfinished(self, save: _Save) -> None:
        """A save whose DCP call failed between our calls: remove what it left behind."""
        if not save.ended:
            _clean_up(save)

    def _write_metadata_tmp(self, save: _Save, metadata: Metadata, layout: CheckpointLayout) -> None:
        metadata.storage_data = layout
        metadata.storage_meta = StorageMeta(checkpoint_id=save.path, save_id=save.dcp_save_id)
        if CURRENT_DCP_VERSION is not None:
            metadata.version = CURRENT_DCP_VERSION
        blob = encode_metadata(metadata, self.sequence)
        tmp = os.path.join(save.path, metadata_tmp_name(layout.save_id))
        write_new_file_durably(tmp, blob)
        save.metadata_tmp = tmp
        save.metadata_obj = metadata

    def _serialize_metadata_early(self, save: _Save, planner: SavePlanner) -> None:
        """Pickle and write the final metadata while the engine writes tensor bytes."""
        if save.plan_cached:
            return  # finish() builds the layout from what the ranks wrote
        metadata = getattr(planner, "metadata", None)
        if not isinstance(metadata, Metadata):
            return  # finish() will serialize it
        layout = save.layout or metadata.storage_data
        if not isinstance(layout, CheckpointLayout):
            return
        t = time.perf_counter()
        self._write_metadata_tmp(save, metadata, layout)
        save.stats.metadata_serialize_s = time.perf_counter() - t

    def _discard_metadata_tmp(self, save: _Save) -> None:
        if save.metadata_tmp is not None:
            remove_if_present([save.metadata_tmp])
            save.metadata_tmp = None


def _new_dcp_id() -> str:
    """A save or load id the way DCP's FileSystemWriter/Reader make them (a uuid4 string)."""
    return str(uuid.uuid4())


def _refuse_committed(path: str) -> None:
    if os.path.exists(os.path.join(path, METADATA_FILE)):
        raise CheckpointExistsError(
            f"{path} already holds a committed checkpoint (.metadata exists), and DataStatesWriter does "
            "not save over one unless asked. DCP's FileSystemWriter replaces it by default (its "
            f"overwrite=True); to do the same, pass DataStatesWriter({path!r}, overwrite=True): the old "
            "checkpoint stays loadable until the new one commits, and its files are removed then"
        )


def _commit_metadata(save: _Save, overwrite: bool) -> None:
    """Rename the save's temporary metadata to ``.metadata``: the commit.

    Without ``overwrite`` the rename never replaces a ``.metadata`` that
    appeared since the save began (another save into the same directory,
    in this process or another, committed first): exactly one of two racing
    saves commits, and the other fails with :class:`CheckpointExistsError`
    and removes its own files.
    """
    final = os.path.join(save.path, METADATA_FILE)
    if overwrite:
        rename_into_place(save.metadata_tmp, final, save.path)
        return
    try:
        rename_without_replacing(save.metadata_tmp, final, save.path)
    except FileExistsError:
        raise CheckpointExistsError(
            f"{save.path}: another save committed a checkpoint there while this one was writing; "
            "this save was not committed and its files were removed (pass "
            "DataStatesWriter(..., overwrite=True) to replace a committed checkpoint instead)"
        ) from None


def _renamed_into_place(save: _Save) -> bool:
    """Whether this save's temporary metadata has already become ``.metadata`` (committed).

    The link-then-unlink commit (filesystems without RENAME_NOREPLACE) may be
    interrupted between its two steps: both names then exist and are one file.
    """
    tmp = save.metadata_tmp
    if tmp is None:
        return False
    final = os.path.join(save.path, METADATA_FILE)
    try:
        if os.path.exists(tmp):
            return os.path.samefile(tmp, final)
    except FileNotFoundError:
        return False
    return os.path.exists(final)


def _end(save: _Save) -> None:
    save.ended = True
    save.job = None
    if save.snapshot is not None:
        save.snapshot.release()


def _clean_up(save: _Save) -> None:
    """Remove the files of a save that will not commit."""
    if _renamed_into_place(save):
        _end(save)  # interrupted right after the rename (KeyboardInterrupt): committed, keep it
        return
    if save.snapshot is not None:
        save.snapshot.cancel("save failed")
    _native.stop_write_job(save.job, "save failed")
    _end(save)
    if save.written_files:
        remove_if_present(save.written_files)
    if save.metadata_tmp is not None:
        remove_if_present([save.metadata_tmp])
        save.metadata_tmp = None


def _snapshot_locations(snap: Snapshot, plan: SavePlan) -> dict:
    """Where the snapshot put each tensor item of the local plan: key -> (offset, nbytes).

    Items are resolved in the staged state dict the way DCP's default planner
    resolves them (flattened keys; a DTensor's local shard).
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    staged = snap.staged_dict
    flat = flatten_state_dict(staged)[0] if isinstance(staged, Mapping) else {}
    out = {}
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        fqn = item.index.fqn
        value = flat.get(fqn)
        if value is None and isinstance(staged, Mapping):
            value = staged.get(fqn)
        placed = snap.location_of(value) if isinstance(value, torch.Tensor) else None
        if placed is None:
            raise CheckpointError(
                f"the save plan holds {fqn!r}, which the snapshot taken by stage() does not; a planner "
                "that changes the state dict's tensors is not supported with dcp.async_save"
            )
        expected = tensor_item_nbytes(item)
        if placed[1] != expected:
            raise CheckpointError(f"{fqn!r}: the snapshot holds {placed[1]} bytes, the plan expects {expected}")
        out[location_key(fqn, item.index.offset)] = placed
    return out


def _files_of_committed(path: str) -> list[str]:
    """Our rank files named by the committed checkpoint in ``path`` (to remove once replaced)."""
    md_path = os.path.join(path, METADATA_FILE)
    try:
        metadata, _ = read_metadata_file(md_path)  # safe mode: never runs code
    except Exception:  # noqa: BLE001 - not ours or unreadable: remove nothing
        return []
    layout = getattr(metadata, "storage_data", None)
    if not isinstance(layout, CheckpointLayout):
        return []
    try:
        layout.validate(md_path)  # only our own rank-file names, never a path out of the directory
    except Exception:  # noqa: BLE001 - damaged: remove nothing
        return []
    return [name for r in layout.ranks for name in (r.data_file, r.index_file)]


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _with_key_context(exc: OSError, spans: list[tuple[int, int, str]]) -> OSError:
    """Re-raise an engine error with the key stored at the failing offset."""
    offset = getattr(exc, "offset", -1)
    key = None
    if offset is not None and offset >= 0:
        spans = sorted(spans)
        i = bisect.bisect_right([s[0] for s in spans], offset) - 1
        if i >= 0 and spans[i][0] <= offset < max(spans[i][1], spans[i][0] + 1):
            key = spans[i][2]
    what = f"writing {key!r}" if key else "writing checkpoint data"
    err = OSError(exc.errno, f"{what} failed: {exc.strerror}", exc.filename)
    err.offset = offset
    return err
