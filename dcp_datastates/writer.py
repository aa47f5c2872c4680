"""DataStatesWriter: the StorageWriter of dcp_datastates.

Per save, on every rank:
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

Saving into a directory that holds a committed checkpoint is refused unless
``overwrite=True``; an overwrite writes new files beside the old ones and
removes the old ones only after the new ``.metadata`` is in place.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import pickle
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from . import _native
from .commit import fsync_dir, publish, remove_if_present, write_new_file_durably
from .errors import CheckpointExistsError, CheckpointError
from .format import (
    DATA_FILE_RE,
    METADATA_FILE,
    CheckpointLayout,
    encode_index,
    metadata_tmp_name,
)
from .layout import (
    PAGE,
    SMALL_ALIGN,
    RankPlanData,
    align_up,
    assign_checkpoint_layout,
    has_layout,
    new_save_id,
    plan_rank_layout,
)
from .providers import provide_object, provide_tensor

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
    submit_s: float = 0.0  # resolving items and handing regions to the engine
    objects_s: float = 0.0  # serializing Python objects (overlaps the engine)
    metadata_serialize_s: float = 0.0  # coordinator: pickling + writing the metadata (overlaps)
    metadata_done_before_data: bool = False  # the engine was still writing when metadata was done
    data_write_s: float = 0.0  # from handing regions to the engine until data fsynced
    index_s: float = 0.0
    commit_s: float = 0.0  # coordinator: finish()


class DataStatesWriter(StorageWriter):
    """Write DCP checkpoints as coalesced per-rank files through the native engine.

    Args:
        path: checkpoint directory (or pass ``checkpoint_id`` to ``dcp.save``).
        overwrite: allow saving over a committed checkpoint in ``path``.
        host_cache_bytes: bytes of reused host staging memory (the engine pool).
        io_threads: threads that checksum and write windows, and read on load.
        window_bytes: size of one write window (one pool slot, one pwrite).
        direct_io: ``"auto"`` (O_DIRECT where the filesystem allows it),
            ``"on"`` (require it) or ``"off"`` (buffered writes).
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        overwrite: bool = False,
        host_cache_bytes: int = _native.DEFAULT_HOST_CACHE_BYTES,
        io_threads: int = _native.DEFAULT_IO_THREADS,
        window_bytes: int = _native.DEFAULT_WINDOW_BYTES,
        direct_io: str = "auto",
    ) -> None:
        super().__init__()
        if direct_io not in _native.DIRECT_IO_MODES:
            raise ValueError(f"direct_io must be one of {_native.DIRECT_IO_MODES}, got {direct_io!r}")
        self.path = os.fspath(path) if path is not None else None
        self.overwrite = overwrite
        self.direct_io = direct_io
        self._engine = _native.get_engine(host_cache_bytes, io_threads, window_bytes)
        self.is_coordinator = False
        self.last_save_stats = SaveStats()
        self._save_id: str | None = None
        self._layout: CheckpointLayout | None = None  # set when the writer (not the planner) placed items
        # Coordinator, from prepare_global_plan to finish: rank -> (RankLayout, plan item
        # indices), so its own write_data and the check of every rank's results reuse them.
        self._rank_layouts: dict = {}
        self._metadata_tmp: str | None = None
        self._metadata_obj: Metadata | None = None
        self._replaced_checkpoint = False

    # -- StorageWriter protocol -------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._save_id = None
        self._layout = None
        self._rank_layouts = {}
        self._metadata_tmp = None
        self._metadata_obj = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            path = os.fspath(checkpoint_id)
        except TypeError:
            return False
        return isinstance(path, str) and "://" not in path

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self._current_save_id())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.path is None:
            raise ValueError("DataStatesWriter has no path: pass one or give dcp.save a checkpoint_id")
        if kwargs.get("use_collectives") is False and _world_size() > 1:
            raise NotImplementedError(
                "DataStatesWriter needs use_collectives=True when several ranks save: rank files "
                "are assigned by the coordinator"
            )
        self.is_coordinator = is_coordinator
        self._current_save_id()
        os.makedirs(self.path, exist_ok=True)
        committed = os.path.exists(os.path.join(self.path, METADATA_FILE))
        if committed and not self.overwrite:
            raise CheckpointExistsError(
                f"{self.path} already holds a committed checkpoint (.metadata exists); pass "
                f"DataStatesWriter(..., overwrite=True) to replace it"
            )
        self._replaced_checkpoint = committed

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        with _native.gc_paused():
            return self._prepare_global_plan(plans)

    def _prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if any(not p.usable for p in plans):
            raise NotImplementedError("DataStatesWriter does not support DCP save-plan caching")
        self._rank_layouts = {}
        if has_layout(plans):  # DataStatesSavePlanner placed everything; its metadata holds the layout
            self._layout = None
            return plans
        plans, self._layout, layouts = assign_checkpoint_layout(plans, self._current_save_id())
        self._rank_layouts = {lay.rank: (lay, [item.index for item in p.items]) for lay, p in zip(layouts, plans)}
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with _native.gc_paused():
            return self._write_data(plan, planner)

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        if not isinstance(info, RankPlanData):
            raise CheckpointError("save plan carries no dcp_datastates layout; was prepare_global_plan skipped?")
        cached = self._rank_layouts.get(info.rank)
        if cached is not None and cached[0].save_id == info.save_id and cached[1] == [i.index for i in plan.items]:
            layout = cached[0]
        else:
            layout = plan_rank_layout(plan.items, info.rank, info.save_id)
        if layout.tensor_bytes_end != info.tensor_bytes_end or len(layout.locations) != info.item_count:
            raise CheckpointError(
                f"rank {info.rank}: local layout disagrees with the coordinator's "
                "(the planner reordered items after global planning)"
            )
        stats = SaveStats(items=len(plan.items))
        data_path = os.path.join(self.path, layout.data_file)
        index_path = os.path.join(self.path, layout.index_file)
        job = None
        try:
            t0 = time.perf_counter()
            regions, keep, results = [], [], []
            for item in plan.items:
                loc = layout.locations[item.index]
                if item.type == WriteItemType.BYTE_IO:
                    continue
                provided = provide_tensor(item, planner.resolve_data(item), loc.length)
                if provided.nbytes:
                    regions.append((provided.pointer, provided.nbytes, loc.offset))
                    keep.append(provided.keep)
                results.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
            job = self._engine.write(
                data_path, regions, keep, direct_io=self.direct_io, preallocate=layout.tensor_bytes_end
            )
            del keep
            t1 = time.perf_counter()
            stats.submit_s = t1 - t0

            objects, object_table = [], []
            offset = layout.objects_base
            for item in plan.items:
                if item.type != WriteItemType.BYTE_IO:
                    continue
                blob = provide_object(item, planner.resolve_data(item))
                offset = align_up(offset, SMALL_ALIGN)
                object_table.append((offset, len(blob)))
                objects.append(blob)
                results.append(WriteResult(index=item.index, size_in_bytes=len(blob), storage_data=layout.locations[item.index]))
                offset += len(blob)
            if objects:
                job.append([(_address(b), len(b), o) for b, (o, _) in zip(objects, object_table) if len(b)], objects)
            job.seal()
            t2 = time.perf_counter()
            stats.objects_s = t2 - t1

            if self.is_coordinator:
                self._serialize_metadata_early(planner, stats)
                stats.metadata_done_before_data = stats.metadata_serialize_s > 0 and not job.done

            try:
                segments = job.wait()
            except OSError as exc:
                raise _with_key_context(exc, plan, layout) from exc
            t3 = time.perf_counter()
            stats.data_write_s = t3 - t0
            stats.direct_io = job.direct
            data_size = align_up(max(offset, layout.tensor_bytes_end), PAGE) if (regions or objects) else 0
            write_new_file_durably(
                index_path, encode_index(info.rank, info.save_id, data_size, segments, object_table)
            )
            stats.index_s = time.perf_counter() - t3
            stats.bytes_written = data_size
        except BaseException:
            if job is not None and not job.done:
                job.cancel("save failed")
                job.seal()
                try:
                    job.wait()
                except OSError:
                    pass
            remove_if_present([data_path, index_path])
            self._discard_metadata_tmp()
            if not self.is_coordinator:
                self._save_id = None
            raise
        self.last_save_stats = stats
        if not self.is_coordinator:
            self._save_id = None  # the next save on this rank gets its id from the coordinator
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with _native.gc_paused():
            self._finish(metadata, results)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        t0 = time.perf_counter()
        try:
            layout = self._layout or metadata.storage_data
            if not isinstance(layout, CheckpointLayout):
                raise CheckpointError("finish() called without a dcp_datastates layout (prepare_global_plan skipped?)")
            for rank, rank_results in enumerate(results):
                planned = self._rank_layouts[rank][0].locations if rank in self._rank_layouts else None
                for wr in rank_results:
                    loc = planned.get(wr.index) if planned is not None else layout.location(wr.index)
                    if loc != wr.storage_data:
                        raise CheckpointError(
                            f"write result for {wr.index.fqn!r} does not match its planned location"
                        )
            if metadata is not self._metadata_obj or self._metadata_tmp is None:
                # The planner did not expose its metadata early: serialize now.
                self._discard_metadata_tmp()
                self._write_metadata_tmp(metadata, layout)
            final = os.path.join(self.path, METADATA_FILE)
            publish(self._metadata_tmp, final, self.path)
            self._metadata_tmp = None
            if self._replaced_checkpoint:
                self._remove_replaced_files(layout.save_id)
        except BaseException:
            self._discard_metadata_tmp()
            raise
        finally:
            self._save_id = None
            self._metadata_obj = None
            self._rank_layouts = {}
        self.last_save_stats.commit_s = time.perf_counter() - t0

    # -- helpers ----------------------------------------------------------------

    def _current_save_id(self) -> str:
        if self._save_id is None:
            self._save_id = new_save_id()
        return self._save_id

    def _write_metadata_tmp(self, metadata: Metadata, layout: CheckpointLayout) -> None:
        metadata.storage_data = layout
        metadata.storage_meta = StorageMeta(checkpoint_id=self.path, save_id=layout.save_id)
        if CURRENT_DCP_VERSION is not None:
            metadata.version = CURRENT_DCP_VERSION
        blob = pickle.dumps(metadata)
        tmp = os.path.join(self.path, metadata_tmp_name(layout.save_id))
        write_new_file_durably(tmp, blob)
        self._metadata_tmp = tmp
        self._metadata_obj = metadata

    def _serialize_metadata_early(self, planner: SavePlanner, stats: SaveStats) -> None:
        """Pickle and write the final metadata while the engine writes tensor bytes."""
        metadata = getattr(planner, "metadata", None)
        if not isinstance(metadata, Metadata):
            return  # finish() will serialize it
        layout = self._layout or metadata.storage_data
        if not isinstance(layout, CheckpointLayout):
            return
        t = time.perf_counter()
        self._write_metadata_tmp(metadata, layout)
        stats.metadata_serialize_s = time.perf_counter() - t

    def _discard_metadata_tmp(self) -> None:
        if self._metadata_tmp is not None:
            remove_if_present([self._metadata_tmp])
            self._metadata_tmp = None

    def _remove_replaced_files(self, save_id: str) -> None:
        stale = []
        for name in os.listdir(self.path):
            m = DATA_FILE_RE.match(name)
            if m and m.group(2) != save_id:
                stale.append(os.path.join(self.path, name))
            elif name.startswith(METADATA_FILE + ".") and name.endswith(".tmp"):
                stale.append(os.path.join(self.path, name))
        remove_if_present(stale)
        if stale:
            fsync_dir(self.path)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _address(blob: bytes) -> int:
    import ctypes

    return ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value


def _with_key_context(exc: OSError, plan: SavePlan, layout) -> OSError:
    """Re-raise an engine error with the key stored at the failing offset."""
    offset = getattr(exc, "offset", -1)
    key = None
    if offset is not None and offset >= 0:
        spans = sorted(
            (loc.offset, loc.offset + loc.length, idx.fqn)
            for idx, loc in layout.locations.items()
            if not loc.is_object
        )
        i = bisect.bisect_right([s[0] for s in spans], offset) - 1
        if i >= 0 and spans[i][0] <= offset < max(spans[i][1], spans[i][0] + 1):
            key = spans[i][2]
    what = f"writing {key!r}" if key else "writing checkpoint data"
    err = OSError(exc.errno, f"{what} failed: {exc.strerror}", exc.filename)
    err.offset = offset
    return err
